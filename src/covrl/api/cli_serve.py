"""`covrl serve`: Tinker's REST API on 127.0.0.1, backed by covrl (covrl.api.tinker_server). Light at import."""

from __future__ import annotations

import argparse
import signal


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Serve Tinker's REST API on 127.0.0.1 from covrl, for Tinker's own SDK and the "
                          "tinker-cookbook recipes: ServiceClient(base_url=<the printed URL>), with TINKER_API_KEY "
                          "set to any value that starts with tml-.")
    parser.add_argument("--config", "-c", default=None,
                        help="the covrl preset or YAML the models are built from (sizes, sampler, warm-up, seed); "
                             "default: the tiny preset for base_model 'tiny', the default SmolLM2 run otherwise")
    parser.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--dir", default="runs/tinker-serve",
                        help="where the training clients keep their checkpoints (a folder per client); a server "
                             "started again over the same folder loads the tinker:// paths an earlier one returned")
    parser.add_argument("--no-warmup", action="store_true", help="skip the config's SFT warm-up for new models")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. sampler.max_new_tokens=32")


def run(args: argparse.Namespace) -> int:
    from covrl.api.tinker_server import serve

    signal.signal(signal.SIGTERM, signal.default_int_handler)   # SIGTERM stops it as Ctrl-C does
    return serve(config=args.config, overrides=list(args.overrides), port=args.port, root=args.dir,
                 warmup=not args.no_warmup)
