"""`jaxlm train | prepare | plot`: parse the command line and call the library. Errors a user can cause end in
one line on stderr (exit status 2), not a traceback."""

from __future__ import annotations

import argparse
import sys
import textwrap

from jaxlm import config as config_lib


def _train_help() -> str:
    lines = ["usage: jaxlm train PRESET_OR_FILE [key=value ...]", "",
             "Train (or resume, when run_dir holds a checkpoint) a model.",
             f"PRESET_OR_FILE: one of {', '.join(config_lib.preset_names())}, or a YAML/JSON file of settings",
             "(a file may name a preset to start from with `base: NAME`).", "", "settings (key: type = default):"]
    for key, t, default, help in config_lib.all_keys():
        lines.append(f"  {key}: {config_lib.type_name(t)} = {default!r}")
        lines.extend(textwrap.wrap(help, width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def cmd_train(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_train_help())
        return 0
    cfg = config_lib.load(argv[0], argv[1:])
    from jaxlm import train

    train.train(cfg)
    return 0


def cmd_prepare(argv: list[str]) -> int:
    from jaxlm.data import prepare

    p = argparse.ArgumentParser(prog="jaxlm prepare", description="Prepare a corpus into train.bin/val.bin/meta.json.")
    p.add_argument("dataset", choices=["shakespeare_char", "python_stdlib", "openwebtext", "text"])
    p.add_argument("files", nargs="*", help="input text files (for `text`)")
    p.add_argument("--input", help="local copy of the corpus (shakespeare_char); no download")
    p.add_argument("--out", help="output folder (default data/<dataset>)")
    p.add_argument("--vocab", choices=["char", "byte"], default="char", help="vocabulary for `text`")
    a = p.parse_args(argv)
    out = a.out or f"data/{a.dataset}"
    if a.dataset == "shakespeare_char":
        meta = prepare.prepare_shakespeare_char(out, a.input)
    elif a.dataset == "python_stdlib":
        meta = prepare.prepare_python_stdlib(out)
    elif a.dataset == "openwebtext":
        meta = prepare.prepare_openwebtext(out)
    else:
        if not a.files:
            p.error("`text` needs at least one input file")
        meta = prepare.prepare_text(a.files, out, a.vocab)
    print(f"wrote {out}: {prepare.describe(meta)}")
    return 0


def cmd_plot(argv: list[str]) -> int:
    from jaxlm import plot

    p = argparse.ArgumentParser(prog="jaxlm plot", description="Plot loss, val loss, tokens/s and MFU of runs.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", help="PNG to write (default RUN_DIR/metrics.png for one run, runs.png for several)")
    a = p.parse_args(argv)
    out = a.out or (f"{a.run_dirs[0]}/metrics.png" if len(a.run_dirs) == 1 else "runs.png")
    print(f"wrote {plot.plot(a.run_dirs, out)}")
    return 0


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "plot": cmd_plot}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: jaxlm {" + ",".join(COMMANDS) + "} ...\n\n"
              "  train PRESET_OR_FILE [key=value ...]   train or resume a model (jaxlm train --help)\n"
              "  prepare DATASET [...]                  corpus -> token files (jaxlm prepare --help)\n"
              "  plot RUN_DIR [RUN_DIR ...]             loss and throughput curves -> PNG (jaxlm plot --help)")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    from jaxlm.checkpoint import CheckpointError
    from jaxlm.data.prepare import DataError
    from jaxlm.data.tokenizer import TokenizerError

    try:
        return COMMANDS[argv[0]](argv[1:])
    except (config_lib.ConfigError, DataError, TokenizerError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
