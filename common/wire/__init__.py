"""The wire: tensor codec, KV chunks, gRPC server helpers and the generated stubs of proto/."""
