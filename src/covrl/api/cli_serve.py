"""`covrl serve`: Tinker's REST API on 127.0.0.1 (or --host), backed by covrl (covrl.api.tinker_server). Light at
import."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import signal
import socket
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Serve Tinker's REST API on 127.0.0.1 from covrl, for Tinker's own SDK and the "
                          "tinker-cookbook recipes: ServiceClient(base_url=<the printed URL>), with TINKER_API_KEY "
                          "set to any value that starts with tml-.")
    parser.add_argument("--config", "-c", default=None,
                        help="the covrl preset or YAML the models are built from (sizes, sampler, warm-up, seed); "
                             "default: the tiny preset for base_model 'tiny', the default SmolLM2 run otherwise")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only); the API has no "
                             "authentication, so any other address lets everyone who reaches it train and sample")
    parser.add_argument("--dir", default="runs/tinker-serve",
                        help="where the training clients keep their checkpoints (a folder per client); a server "
                             "started again over the same folder loads the tinker:// paths an earlier one returned")
    parser.add_argument("--no-warmup", action="store_true", help="skip the config's SFT warm-up for new models")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. sampler.max_new_tokens=32")


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
        raise ValueError(f"--host {host!r}: not an IPv4 address or a host name this machine resolves "
                         f"({err.strerror}); use 127.0.0.1 (this machine only) or an address of one of its network "
                         "interfaces") from err
    except OSError as err:
        text = {errno.EADDRINUSE: f"--port {port}: already in use on {host} (another server listens there); choose "
                                  "another port, or --port 0 for any free one",
                errno.EADDRNOTAVAIL: f"--host {host!r}: not an address of this machine; use 127.0.0.1 (this machine "
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
        check_address(args.host, args.port)
    except ValueError as err:
        return user_error("covrl serve", err)
    if not _is_loopback(args.host):
        print(f"covrl serve: warning: listening on {args.host}: the API has no authentication; anyone who reaches "
              "this address can train and sample", file=sys.stderr, flush=True)
    from covrl.api.tinker_server import serve

    signal.signal(signal.SIGTERM, signal.default_int_handler)   # SIGTERM stops it as Ctrl-C does
    try:
        return serve(config=args.config, overrides=list(args.overrides), port=args.port, root=args.dir,
                     warmup=not args.no_warmup, host=args.host)
    except (ValueError, FileNotFoundError) as err:   # the config: a missing file, an unknown preset or key
        return user_error("covrl serve", err)
