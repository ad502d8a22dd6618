"""`jaxlm train | prepare`: parse the command line and call the library. Errors a user can cause end in
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


def cmd_eval(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxlm eval RUN_DIR [key=value ...]\n\n"
              "Restore the latest checkpoint of a training run, print its train/val loss on the batches training\n"
              "evaluated on, and a sample (training.sample_tokens=0 skips it). Settings override the run's\n"
              "config.json, e.g. model.quantization=int8_weights evaluates and samples with int8-stored weights\n"
              "and prints the float figures beside them.")
        return 0 if argv else 2
    from jaxlm import evaluate

    evaluate.evaluate_run(argv[0], config_lib.parse_overrides(argv[1:]))
    return 0


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "eval": cmd_eval}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: jaxlm {" + ",".join(COMMANDS) + "} ...\n\n"
              "  train PRESET_OR_FILE [key=value ...]   train or resume a model (jaxlm train --help)\n"
              "  prepare DATASET [...]                  corpus -> token files (jaxlm prepare --help)\n"
              "  eval RUN_DIR [key=value ...]           losses and a sample of a trained run (jaxlm eval --help)")
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
    except BrokenPipeError:  # output piped into `head` and the like
        return 0


if __name__ == "__main__":
    sys.exit(main())
