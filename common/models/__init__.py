"""Model code: checkpoint config, rotary embedding, the decoder, the safetensors loader."""
