"""The KV transport between prefill and decode: one interface, two roles, three backends.

sender.py (prefill) and receiver.py (decode) are the interface, each with its one factory; plan.py
plans where every byte goes, once for every backend; staging.py says where the prefill worker's
copy-out lands and how a transfer thread waits for it; grpc_bytes.py, mooncake.py and shm.py are the
backends (address_writes.py holds what the two address-writing ones share). docs/transfer.md
describes the whole.
"""
