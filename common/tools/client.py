"""Client library and CLI for the decode service (gRPC SglangScheduler).

    python -m common.tools.client --addr 127.0.0.1:30000 "What is the capital of France?" [--chat]
    python -m common.tools.client --addr 127.0.0.1:30000 --ids 5,6,7 --max-new-tokens 8

Text goes through the model's tokenizer (the folder the service reports, or --tokenizer); the answer
is printed as it streams. With --ids, raw token ids go in and come out.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Iterator

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.wire import security
from common.wire.grpc_server import channel_options

_counter = itertools.count()


class Client:
    def __init__(
        self,
        address: str,
        tokenizer_path: str | None = None,
        api_key: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ):
        """`api_key`: sent as authorization: Bearer <key>; `tls_ca_file`: talk TLS, trusting that CA
        (with `tls_cert_file` and `tls_key_file` as our identity for mutual TLS)."""
        credentials = security.channel_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        self.channel = security.channel(address, channel_options(), credentials)
        self.channel = security.with_key(self.channel, api_key)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self._tokenizer_path = tokenizer_path
        self._tokenizer = None
        self.last_complete: pb.GenerateComplete | None = None

    def close(self) -> None:
        self.channel.close()

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from common.tools.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self._tokenizer_path or self.model_info().tokenizer_path)
        return self._tokenizer

    def generate_ids(
        self,
        ids: list[int],
        max_new_tokens: int | None = None,
        stream: bool = True,
        request_id: str | None = None,
        **sampling,
    ) -> Iterator[list[int]]:
        """Yield lists of new token ids as they arrive; `last_complete` holds the final Complete."""
        sp = pb.SamplingParams(**sampling)
        if max_new_tokens is not None:
            sp.max_new_tokens = max_new_tokens
        request = pb.GenerateRequest(
            request_id=request_id or f"client-{os.getpid()}-{next(_counter)}",
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=sp,
            stream=stream,
        )
        self.last_complete = None
        for reply in self.stub.Generate(request):
            if reply.HasField("chunk"):
                yield list(reply.chunk.token_ids)
            else:
                self.last_complete = reply.complete
                if not stream:
                    yield list(reply.complete.output_ids)

    def generate_text(self, prompt: str, chat: bool = False, **kwargs) -> Iterator[str]:
        """Yield text deltas; an incomplete UTF-8 tail (U+FFFD) is held back until it completes."""
        tok = self.tokenizer
        if chat:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok.encode(prompt)
        out, shown = [], ""
        for new in self.generate_ids(ids, **kwargs):
            out.extend(new)
            text = tok.decode(out, skip_special_tokens=True)
            stable = text.rstrip("\ufffd")
            if len(stable) > len(shown) and stable.startswith(shown):
                yield stable[len(shown) :]
                shown = stable
        text = tok.decode(out, skip_special_tokens=True)
        if text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown) :]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.tools.client", description="Talk to the decode service.")
    p.add_argument("prompt", nargs="?", default=None)
    p.add_argument("--addr", default="127.0.0.1:30000")
    p.add_argument("--ids", default=None, help="comma-separated token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="(not on the SglangScheduler wire; ignored)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the one the service reports)")
    p.add_argument(
        "--api-key", default=os.environ.get("DISAGG_API_KEY"), help="the front door's key (env DISAGG_API_KEY)"
    )
    p.add_argument("--tls-ca-file", default=None, help="talk TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert-file", default=None, help="mutual TLS: our certificate (PEM)")
    p.add_argument("--tls-key-file", default=None, help="mutual TLS: our private key (PEM)")
    args = p.parse_args(argv)
    client = Client(args.addr, args.tokenizer, args.api_key, args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    try:
        if args.ids is not None:
            ids = [int(x) for x in args.ids.split(",") if x.strip()]
            for new in client.generate_ids(ids, args.max_new_tokens, temperature=args.temperature):
                print(" ".join(map(str, new)), end=" ", flush=True)
        else:
            if args.prompt is None:
                p.error("give a prompt or --ids")
            for delta in client.generate_text(
                args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens, temperature=args.temperature
            ):
                print(delta, end="", flush=True)
        c = client.last_complete
        print(f"\n[{c.finish_reason}: {c.prompt_tokens} prompt + {c.completion_tokens} completion tokens]")
        return 0
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    raise SystemExit(main())
