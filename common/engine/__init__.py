"""The engine: pools and allocator, forward batch, model runner, sampling, streams, the handoff record.

Imports nothing from common.wire or common.tools, so it runs without gRPC installed."""
