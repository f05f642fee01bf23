"""Make an internal key file once: `python -m common.tools.keygen PATH`.

compose runs this as a one-shot service before prefill and decode, writing into a volume only the
services mount, so `docker compose up` gets a fresh random internal key without one on any command
line or in any environment. The file is created with O_EXCL and mode 0400 (owner only); a key
already there is kept, so a restart keeps the pair's key. Exit status 0 when the file holds a
usable key afterwards.
"""

from __future__ import annotations

import os
import secrets
import sys

from common import api_keys


def ensure_key(path: str) -> bool:
    """Create `path` with a fresh key unless it exists; True if this call made it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    except FileExistsError:
        api_keys.read_key_file(path, "--internal-api-key-file")  # an existing file must be a usable key
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return True


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    made = ensure_key(args[0])
    print(f"[keygen] {'made a new' if made else 'kept the'} internal key in {args[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
