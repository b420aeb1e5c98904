"""`covrl serve`: Tinker's REST API on 127.0.0.1 (or --host, with API keys), backed by covrl
(covrl.api.tinker_server). Light at import."""

from __future__ import annotations

import argparse
import errno
import hashlib
import ipaddress
import os
import re
import signal
import socket
from pathlib import Path

KEYS_ENV = "COVRL_SERVE_KEYS"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a number above 0 is needed")
        return value
    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Serve Tinker's REST API from covrl, for Tinker's own SDK and the tinker-cookbook "
                          "recipes: ServiceClient(base_url=<the printed URL>). On 127.0.0.1 without keys any "
                          "TINKER_API_KEY that starts with tml- is accepted; with --keys (or $COVRL_SERVE_KEYS) each "
                          "key is a tenant with its own models, samplers and checkpoints.")
    parser.add_argument("--config", "-c", default=None,
                        help="the covrl preset or YAML the models are built from (sizes, sampler, warm-up, seed); "
                             "default: the tiny preset for base_model 'tiny', the default SmolLM2 run otherwise")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: loopback only); any other address "
                             "needs --keys, and a TLS-terminating proxy in front (docs/api.md, Serving a team)")
    parser.add_argument("--dir", default="runs/tinker-serve",
                        help="where the training clients keep their checkpoints (a folder per client; with keys "
                             "under tenants/<name>/); a server started again over the same folder loads the "
                             "tinker:// paths an earlier one returned")
    parser.add_argument("--keys", metavar="FILE", default=None,
                        help="API keys, one per line, each optionally after a tenant name: 'alice: tml-...' (a "
                             "key alone is a tenant of its own); '#' starts a comment. Also read from "
                             f"${KEYS_ENV} (entries separated by commas or newlines)")
    parser.add_argument("--max-body-mb", type=_positive(float), metavar="MB", default=64.0,
                        help="the largest request body accepted, in MB (413 beyond; default 64)")
    parser.add_argument("--max-training-clients", type=_positive(int), metavar="N", default=None,
                        help="training clients each tenant may hold at once (default: no limit)")
    parser.add_argument("--max-queued", type=_positive(int), metavar="N", default=1024,
                        help="calls each tenant may have waiting or running (default 1024; 429 beyond, which "
                             "the SDK retries)")
    parser.add_argument("--max-checkpoint-mb", type=_positive(float), metavar="MB", default=None,
                        help="disk each tenant's folder may use, checked before each save (default: no limit)")
    parser.add_argument("--keep-last", type=_positive(int), metavar="N", default=None,
                        help="training states kept per training client; older ones are deleted after each save "
                             "(default: all)")
    parser.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                        help="with keys: a folder whose model folders tenants may name as base_model (repeatable; "
                             "without it only the models covrl knows by name are served)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the config's SFT warm-up for new models")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. sampler.max_new_tokens=32")


def parse_keys(entries: list[str], where: str) -> dict[str, str]:
    """`name: key` or `key` entries -> {key: tenant name}. Messages name the entry (`where` N), never its key."""
    keys: dict[str, str] = {}
    for number, entry in enumerate(entries, 1):
        entry = entry.strip()
        if not entry or entry.startswith("#"):
            continue
        name, sep, key = entry.partition(":")
        name, key = (name.strip(), key.strip()) if sep else (None, name.strip())
        if not key.startswith("tml-") or len(key) < 12 or any(c.isspace() for c in key):
            raise ValueError(f"{where} {number}: a key is 'tml-' and at least 8 more characters, without spaces "
                             "(the Tinker SDK sends only keys that start with tml-)")
        if name is None:     # a stable name, so the tenant's folder is the same after a restart
            name = "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]
        if not _TENANT_NAME.fullmatch(name):
            raise ValueError(f"{where} {number}: tenant name {name!r}: letters, digits, '_', '.', '-' (up to 64, "
                             "not starting with '.' or '-')")
        if key in keys:
            raise ValueError(f"{where} {number}: this key is listed already (for tenant {keys[key]!r})")
        keys[key] = name
    return keys


def read_keys(path: str | None, env: str | None) -> dict[str, str]:
    """The API keys of `--keys FILE` and of $COVRL_SERVE_KEYS (`env`), as {key: tenant name}."""
    keys: dict[str, str] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"--keys {path}: cannot be read ({err.strerror or err})") from None
        keys = parse_keys(text.splitlines(), f"--keys {path} line")
        if not keys:
            raise ValueError(f"--keys {path}: no keys in it (one per line: 'alice: tml-...')")
    if env:
        for key, name in parse_keys(re.split(r"[,\n]", env), f"${KEYS_ENV} entry").items():
            if keys.get(key, name) != name:
                raise ValueError(f"${KEYS_ENV}: a key of --keys {path} is given to another tenant here")
            keys[key] = name
    return keys


def check_address(host: str, port: int) -> None:
    """A ValueError saying, in the options' terms, why `covrl serve` cannot listen on host:port. Checked by binding
    a socket as the server will (IPv4, SO_REUSEADDR), before the models and torch are loaded."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OverflowError, ValueError) as err:
        raise ValueError(f"--port {port}: not a port number (0 to 65535; 0 picks a free one)") from err
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r}: not an IPv4 address or a host name that resolves here "
                         f"({err.strerror}); use 127.0.0.1 (loopback only) or an address of one of its network "
                         "interfaces") from err
    except OSError as err:
        text = {errno.EADDRINUSE: f"--port {port}: already in use on {host} (another server listens there); choose "
                                  "another port, or --port 0 for any free one",
                errno.EADDRNOTAVAIL: f"--host {host!r}: not an address of this host; use 127.0.0.1 (loopback "
                                     "only) or an address of one of its network interfaces",
                errno.EACCES: f"--port {port}: permission denied (ports below 1024 need root); choose a port from "
                              "1024 up"}.get(err.errno, f"cannot listen on {host}:{port}: {err.strerror or err}")
        raise ValueError(text) from err
    finally:
        sock.close()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(args: argparse.Namespace) -> int:
    from covrl.settings import user_error

    try:
        keys = read_keys(args.keys, os.environ.get(KEYS_ENV))
        check_address(args.host, args.port)
        if not keys and not _is_loopback(args.host):
            raise ValueError(f"--host {args.host!r}: listening beyond loopback needs API keys (--keys FILE or "
                             f"${KEYS_ENV}: 'alice: tml-...'), and a TLS-terminating proxy in front of the server "
                             "(docs/api.md, Serving a team); or listen on 127.0.0.1")
        for folder in args.models_dir:
            if not Path(folder).is_dir():
                raise ValueError(f"--models-dir {folder}: not a folder")
    except ValueError as err:
        return user_error("covrl serve", err)
    from covrl.api.tinker_server import Limits, serve

    limits = Limits(max_training_clients=args.max_training_clients, max_queued=args.max_queued,
                    max_checkpoint_mb=args.max_checkpoint_mb, keep_last=args.keep_last, max_body_mb=args.max_body_mb)
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # SIGTERM stops it as Ctrl-C does
    try:
        return serve(config=args.config, overrides=list(args.overrides), port=args.port, root=args.dir,
                     warmup=not args.no_warmup, host=args.host, keys=keys, limits=limits,
                     model_dirs=args.models_dir)
    except (ValueError, FileNotFoundError) as err:   # the config: a missing file, an unknown preset or key
        return user_error("covrl serve", err)
