"""`jaxlm train | compile | prepare | plot | convert | generate | serve | eval`: parse the command line and call the library.
Errors a user can cause end in one line on stderr (exit status 2), not a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import textwrap
from pathlib import Path

from jaxlm import config as config_lib
from jaxlm.errors import UserError, require_extra


def _train_help() -> str:
    lines = ["usage: jaxlm train PRESET_OR_FILE [key=value ...]", "",
             "Train (or resume, when run_dir holds a checkpoint) a model.",
             f"PRESET_OR_FILE: one of {', '.join(config_lib.preset_names())}, or a YAML/JSON file of settings",
             "(a file may name a preset to start from with `base: NAME`).", "", "settings (key: type = default):"]
    for key, t, default, help in config_lib.all_keys():
        lines.append(f"  {config_lib.spelled(key)}: {config_lib.type_name(t)} = {default!r}")
        lines.extend(textwrap.wrap(help, width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def cmd_train(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_train_help())
        return 0
    print_params = "--print-params" in argv
    argv = [a for a in argv if a != "--print-params"]
    cfg = config_lib.load(argv[0], argv[1:])
    if print_params:
        from jaxlm import params
        from jaxlm.model import flops, param_specs

        model = config_lib.apply_parameter_scale(cfg.model)
        if model.vocab_size is None:
            raise config_lib.ConfigError("--print-params needs model.vocab_size (it is otherwise read from the data)")
        c = flops.param_counts(model)
        print(f"parameters {params.count(param_specs(model)):,} (non-embedding "
              f"{flops.non_embedding_params(model):,}; active per token {c['active']:,}): {model.n_layers} layers, "
              f"width {model.d_model}, {model.n_heads} heads of {model.hd}, MLP {model.ff}")
        return 0
    from jaxlm.train import loop as train

    train.train(cfg)
    return 0


def cmd_compile(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxlm compile PRESET_OR_FILE compile.topology=NAME [compile.num_slices=N] [key=value ...]\n\n"
              "Compile the train step ahead of time for a target from abstract shapes (nothing is allocated) and\n"
              "report its memory per device against the target's HBM. NAME: a TPU slice such as v4-8, v5e-16,\n"
              "v5e-256, v5p-128, v6e-256 (needs pip install 'jaxlm[tpu]'; runs on a CPU-only host), cpu-N (N CPU\n"
              "devices), or a3 (8 x H100 per host, compiled on such a host). compile.output=FILE saves the step for\n"
              "`jaxlm train ... compile.load=FILE`; compile.find_batch_size=true searches the largest\n"
              "training.per_device_batch_size that fits. The report ends with bytes_per_device=N, hbm_bytes=N and\n"
              "fits=true|false; the exit status is 1 when the step does not fit. Settings: `jaxlm train --help`;\n"
              "guide: docs/aot.md.")
        return 0 if argv else 2
    cfg = config_lib.load(argv[0], argv[1:])
    from jaxlm.train import aot

    aot.prepare_process(cfg.compile)
    return 0 if aot.compile_command(cfg)["fits"] else 1


def cmd_launch(argv: list[str]) -> int:
    from jaxlm.launch import clusters

    p = argparse.ArgumentParser(
        prog="jaxlm launch", description="Run a jaxlm command as one JAX job of several processes: here (local: "
        "a coordinator on 127.0.0.1), or through a cluster's scheduler: an sbatch script (slurm), an indexed Job "
        "and headless Service (kubernetes), or gcloud command lines for a TPU VM slice (tpu-vm). docs/scaling.md.")
    p.add_argument("--scheduler", choices=clusters.SCHEDULERS, default="local")
    p.add_argument("--processes", type=int, help="local: processes to start")
    p.add_argument("--devices-per-process", type=int, help="fake CPU devices per process (testing; local, slurm)")
    p.add_argument("--gpus-per-process", type=int, help="GPUs per process: per local process, per Slurm task "
                   "(--gpus-per-task), per Kubernetes pod")
    p.add_argument("--port", type=int, help="local: coordinator port (default: a free one)")
    p.add_argument("--nodes", type=int, help="slurm: nodes; kubernetes: pods (hosts)")
    p.add_argument("--tasks-per-node", type=int, default=1, help="slurm: processes per node (default 1)")
    p.add_argument("--time", help="slurm: time limit (sbatch --time, e.g. 24:00:00)")
    p.add_argument("--partition", help="slurm: partition")
    p.add_argument("--account", help="slurm: account")
    p.add_argument("--signal-seconds", type=int, default=300, help="slurm: seconds before the time limit at which "
                   "the tasks get SIGTERM and save a checkpoint (default 300)")
    p.add_argument("--requeues", type=int, default=3, help="slurm: times the job is requeued after a failure or a "
                   "preemption (default 3); kubernetes: restarts per pod")
    p.add_argument("--name", default="jaxlm", help="job name (slurm, kubernetes) or TPU VM name (tpu-vm)")
    p.add_argument("--output-dir", default="slurm", help="slurm: folder for the script and the job's output")
    p.add_argument("--sbatch", action="append", metavar="FLAG", help="slurm: another #SBATCH line (repeatable), "
                   "e.g. --sbatch=--exclusive")
    p.add_argument("--image", help="kubernetes: container image with jaxlm installed (its `jaxlm` on PATH)")
    p.add_argument("--topology", help="tpu-vm, kubernetes: TPU slice such as v5e-256 (jaxlm describe NAME)")
    p.add_argument("--zone", help="tpu-vm: zone")
    p.add_argument("--project", help="tpu-vm: project")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--submit", action="store_true", help="slurm: sbatch the script; kubernetes: kubectl apply")
    how.add_argument("--dry-run", action="store_true", help="print the script, manifest or command lines "
                     "(the default for slurm, kubernetes and tpu-vm)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- train PRESET key=value ...")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the command after --, e.g. jaxlm launch --processes 2 -- train quickstart")
    if a.scheduler == "local":
        if a.processes is None or a.processes < 1:
            p.error("--processes N (>= 1) is needed for local processes")
        from jaxlm.launch.local import launch

        return launch(command, a.processes, a.devices_per_process, a.port, a.gpus_per_process)
    if a.scheduler == "slurm":
        if a.nodes is None:
            p.error("--nodes N is needed for --scheduler slurm")
        script = clusters.slurm_script(command, a.nodes, a.tasks_per_node, a.gpus_per_process,
                                       a.devices_per_process, a.time, a.partition, a.account, a.name, a.requeues,
                                       a.signal_seconds, a.output_dir, extra=a.sbatch)
        if not a.submit:
            print(script, end="")
            return 0
        path, job = clusters.submit_slurm(script, a.output_dir, a.name)
        print(f"submitted job {job}: {path}; output in {path.parent}/{a.name}-{job}.out")
        return 0
    if a.scheduler == "kubernetes":
        if a.nodes is None and not a.topology:
            p.error("--nodes N (pods) or --topology SLICE is needed for --scheduler kubernetes")
        if not a.image:
            p.error("--image IMAGE (with jaxlm installed) is needed for --scheduler kubernetes")
        import yaml

        from jaxlm.launch.topology import tpu_slice

        hosts = a.nodes if a.nodes is not None else tpu_slice(a.topology).workers
        manifest = yaml.safe_dump_all(clusters.kubernetes_manifest(
            command, a.name, a.image, hosts, a.gpus_per_process, a.topology, a.requeues), sort_keys=False)
        if not a.submit:
            print(manifest, end="")
            return 0
        return clusters.apply_kubernetes(manifest)
    if not (a.topology and a.zone):
        p.error("--topology SLICE and --zone ZONE are needed for --scheduler tpu-vm")
    if a.submit:
        p.error("--scheduler tpu-vm prints the gcloud command lines; run them yourself (no --submit)")
    print(clusters.tpu_vm_text(clusters.tpu_vm_commands(command, a.name, a.topology, a.zone, a.project), a.topology),
          end="")
    return 0


def cmd_describe(argv: list[str]) -> int:
    """A TPU slice (v5e-256: chips, grid, workers, gcloud's accelerator type) or a model (a preset or settings
    file: parameter counts, layers, FLOPs, KV-cache bytes per token)."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxlm describe TOPOLOGY | PRESET_OR_FILE [key=value ...]\n\n"
              "TOPOLOGY (a TPU slice such as v4-8, v5e-256, v5p-128, v6e-256): its chips, chip grid, workers (host\n"
              "VMs) and chips per worker, gcloud's accelerator type and version.\n"
              "PRESET_OR_FILE: the model's parameter counts (total, active per token with and without the input\n"
              "embedding table, embedding, multi-token prediction modules), layer layout, training FLOPs per token\n"
              "and KV-cache bytes per token, from its settings alone (nothing is allocated).")
        return 0 if argv else 2
    if re.fullmatch(r"v\d+[a-z]?-\d+", argv[0].strip().lower()):
        from jaxlm.launch.topology import tpu_slice

        if len(argv) > 1:
            raise config_lib.ConfigError(f"jaxlm describe {argv[0]} takes no settings (got {argv[1]!r})")
        print("\n".join(tpu_slice(argv[0]).lines()))
        return 0
    from jaxlm.model import flops

    cfg = config_lib.load(argv[0], argv[1:])
    model = config_lib.apply_parameter_scale(cfg.model)
    if model.vocab_size is None:
        raise config_lib.ConfigError("jaxlm describe needs model.vocab_size (it is otherwise read from the data)")
    print("\n".join(flops.describe_model(model)))
    return 0


def _prepare_common(p: argparse.ArgumentParser) -> None:
    from jaxlm.data import prepare

    p.add_argument("--out", required=True, help="output folder (format 2: shards, index, meta.json written last)")
    p.add_argument("--tokenizer", required=True, help="byte, a tiktoken encoding or .tiktoken file, a "
                   "SentencePiece .model, a tokenizer.json, a folder holding one (a `jaxlm convert from-hf` "
                   "folder works), or a hub id (docs/data.md)")
    p.add_argument("--val", nargs="+", metavar="INPUT", help="separate validation inputs (default: a fraction of "
                   "the documents, --val-fraction)")
    p.add_argument("--split", default="train", help="split of a datasets: input (default train)")
    p.add_argument("--streaming", action="store_true", help="stream a datasets: input instead of downloading it")
    p.add_argument("--workers", type=int, help="tokenizer processes (default: all cores; 0 = this process)")
    p.add_argument("--shard-tokens", type=int, help="tokens per shard before it is closed at a document boundary")
    p.add_argument("--vocab-size", type=int, help="the model's vocabulary: ids at or above it are refused "
                   "(default: the tokenizer's, or the converted model's when --tokenizer is its folder)")
    p.add_argument("--errors", choices=prepare.UTF8_ERRORS, default="replace",
                   help="invalid UTF-8: replace by U+FFFD (default), skip (drop the bytes) or strict (fail at the "
                        "first, naming file and line); the counts are printed either way")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _report(out: str, meta: dict) -> None:
    from jaxlm.data import prepare

    s = meta["splits"]
    print(f"read {prepare.describe_stats(meta['skipped'])}")
    unit, per = ("pairs", 2) if meta.get("kind") == "preference" else ("documents", 1)
    print(f"wrote {out}: train {s['train']['documents'] // per:,} {unit} / {s['train']['tokens']:,} tokens in "
          f"{len(s['train']['shards'])} shard(s), val {s['val']['documents'] // per:,} {unit} / "
          f"{s['val']['tokens']:,} tokens; vocab {meta['vocab_size']:,} ({meta['tokenizer']['kind']})")


def _prepare_kind_args(p: argparse.ArgumentParser, chat: bool, pref: bool) -> None:
    """The options of `jaxlm prepare chat`, `preference` or `corpus` beyond the common ones."""
    if chat or pref:
        p.add_argument("--images", action="store_true", help="messages hold image parts (a vision-language "
                       "model; for pairs, the prompt's messages): --tokenizer is the converted model's folder, the "
                       "images are kept resized beside the shards (docs/vision.md)")
        p.add_argument("--bad-images", choices=("skip", "stop"), default="skip", help="with --images: a "
                       "missing, corrupt or oversized image leaves its record out (counted; default) or "
                       "stops the run, naming its file and line")
        p.add_argument("--max-image-pixels", type=int, help="with --images: pixels of one image at most "
                       "(default 64 Mi), checked before it is decoded")
        p.add_argument("--image-tokens", type=int, help="with --images, Qwen2.5-VL / Qwen3-VL: each image at its "
                       "own aspect ratio and grid as the processor resizes it, within this many soft tokens "
                       "(default 256; docs/vision.md)")
        p.add_argument("--image-side", type=int, help="with --images, Qwen2.5-VL / Qwen3-VL, instead of "
                       "--image-tokens: each image resized to a square of this side, a multiple of patch x merge")
        p.add_argument("--max-tiles", type=int, help="with --images, Llama 4: each image's tiles on a canvas of at "
                       "most this many, then the global tile (default: preprocessor_config.json's max_patches)")
    if chat:
        p.add_argument("--max-tokens", type=int, required=True, help="the training block size: longer "
                       "conversations are dropped and counted, never cut")
        p.add_argument("--chat-template", help="Jinja chat template file (default: the tokenizer's)")
        p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of the records for val")
    elif pref:
        p.add_argument("--max-tokens", type=int, help="the training block size: a pair whose two documents "
                       "(prompt + chosen, prompt + rejected) have more tokens together is refused, never cut "
                       "(default: no limit here; training checks its block size)")
        p.add_argument("--drop-long", action="store_true", help="drop and count pairs over --max-tokens "
                       "instead of refusing them (this skews the data toward short replies)")
        p.add_argument("--chat-template", help="Jinja chat template file for records given as messages "
                       "(default: the tokenizer's)")
        p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of the pairs for val")
    else:
        p.add_argument("--field", default="text", help="record field holding the text (default text)")
        p.add_argument("--per-line", action="store_true", help="each line of a .txt file is a document "
                       "(default: the whole file is one)")
        p.add_argument("--val-fraction", type=float, default=0.0005, help="fraction of the documents for val")
        p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS", help="encode on a Ray cluster: "
                       "its head's host:port or auto, or no address to start one here; --workers caps the "
                       "tasks at a time; a rerun resumes an interrupted prepare (docs/data.md)")


def cmd_prepare(argv: list[str]) -> int:
    from jaxlm.data import prepare

    if argv[:1] in (["corpus"], ["chat"], ["preference"]):
        chat, pref = argv[0] == "chat", argv[0] == "preference"
        p = argparse.ArgumentParser(
            prog=f"jaxlm prepare {argv[0]}",
            description="Chat records (`messages` or prompt/completion) -> tokens + a loss mask on assistant tokens."
            if chat else "Preference records (prompt, chosen, rejected: strings, or chat messages rendered with the "
            "chat template) -> pairs of documents with a loss mask on the replies, for training.objective=dpo|ipo|"
            "orpo (docs/preference.md)." if pref else
            "Any corpus through any tokenizer -> format-2 token shards (docs/data.md).")
        p.add_argument("inputs", nargs="+", metavar="INPUT", help="files (.txt .jsonl .json .parquet, optionally "
                       ".gz/.zst), folders, globs, s3:// or gs:// URLs, or datasets:NAME")
        _prepare_common(p)
        _prepare_kind_args(p, chat, pref)
        a = p.parse_args(argv[1:])
        if not 0 <= a.val_fraction < 1:
            p.error(f"--val-fraction {a.val_fraction} must be in [0, 1)")
        common = dict(val=a.val, val_fraction=a.val_fraction, errors=a.errors, split=a.split, streaming=a.streaming,
                      workers=a.workers, shard_tokens=a.shard_tokens, vocab_size=a.vocab_size,
                      progress=not a.no_progress)
        if (chat or pref) and a.images:
            from jaxlm.data import vision_data

            meta = vision_data.prepare_vision_chat(a.inputs, a.out, a.tokenizer, max_tokens=a.max_tokens, val=a.val,
                                                   val_fraction=a.val_fraction, bad_images=a.bad_images, pairs=pref,
                                                   max_pixels=a.max_image_pixels, max_tiles=a.max_tiles,
                                                   image_side=a.image_side, image_tokens=a.image_tokens)
        elif chat:
            meta = prepare.prepare_chat(a.inputs, a.out, a.tokenizer, a.max_tokens, a.chat_template, **common)
        elif pref:
            meta = prepare.prepare_preference(a.inputs, a.out, a.tokenizer, a.max_tokens, a.chat_template,
                                              a.drop_long, **common)
        elif a.ray is not None:
            from jaxlm.data import ray_prepare

            meta = ray_prepare.prepare_corpus(a.inputs, a.out, a.tokenizer, a.ray, a.val, a.val_fraction, a.field,
                                              a.errors, a.per_line, a.workers, a.shard_tokens, a.vocab_size,
                                              not a.no_progress)
        else:
            meta = prepare.prepare_corpus(a.inputs, a.out, a.tokenizer, field=a.field, per_line=a.per_line,
                                          **common)
        _report(a.out, meta)
        return 0
    p = argparse.ArgumentParser(prog="jaxlm prepare", description="Prepare a corpus. `jaxlm prepare corpus "
                                "INPUT... --tokenizer T --out DIR` takes any inputs and tokenizer, `jaxlm prepare "
                                "chat FILE.jsonl --tokenizer T --max-tokens N --out DIR` chat data, `jaxlm prepare "
                                "preference FILE.jsonl --tokenizer T --out DIR` preference pairs (see their "
                                "--help); the presets below write nanoGPT's train.bin/val.bin/meta.json.")
    p.add_argument("dataset", choices=["shakespeare_char", "python_stdlib", "openwebtext", "text"])
    p.add_argument("files", nargs="*", help="input text files (for `text`)")
    p.add_argument("--input", help="local copy of the corpus (shakespeare_char); no download")
    p.add_argument("--out", help="output folder (default data/<dataset>)")
    p.add_argument("--vocab", choices=["char", "byte"], default="char", help="vocabulary for `text`")
    p.add_argument("--errors", choices=prepare.UTF8_ERRORS, default="replace",
                   help="invalid UTF-8 in `text` or shakespeare_char input: replace by U+FFFD (default), skip "
                        "(drop the bytes) or strict (fail); the counts are printed either way")
    a = p.parse_args(argv)
    out = a.out or f"data/{a.dataset}"
    if a.dataset == "shakespeare_char":
        meta = prepare.prepare_shakespeare_char(out, a.input, a.errors)
    elif a.dataset == "python_stdlib":
        meta = prepare.prepare_python_stdlib(out)
    elif a.dataset == "openwebtext":
        meta = prepare.prepare_openwebtext(out)
    else:
        if not a.files:
            p.error("`text` needs at least one input file")
        meta = prepare.prepare_text(a.files, out, a.vocab, a.errors)
    if "input" in meta:
        print(prepare.describe_input(meta["input"], meta["input"]["utf8_errors"]))
    print(f"wrote {out}: {prepare.describe(meta)}")
    return 0


def cmd_tokenizer(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxlm tokenizer", description="Train a tokenizer.")
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("train", help="byte-level BPE (Hugging Face tokenizers) -> DIR/tokenizer.json")
    t.add_argument("inputs", nargs="+", metavar="INPUT", help="inputs as for `jaxlm prepare corpus`")
    t.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary (>= 257)")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--field", default="text", help="record field holding the text (default text)")
    t.add_argument("--per-line", action="store_true", help="each line of a .txt file is a document")
    t.add_argument("--special-token", action="append", help="special tokens (default <|endoftext|>, the EOS)")
    a = p.parse_args(argv)
    from jaxlm.data import bpe, tokenizer

    out = bpe.train_bpe(a.inputs, a.vocab_size, a.out, a.field, tuple(a.special_token or ["<|endoftext|>"]),
                        a.per_line)
    tok = tokenizer.load(out)
    print(f"wrote {out / 'tokenizer.json'}: byte-level BPE, vocab {tok.vocab_size:,}, EOS id {tok.eos_id}; use "
          f"it with --tokenizer {out}")
    return 0


def cmd_convert(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxlm convert", description="Hugging Face checkpoints in and out.")
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("from-hf", help="HF folder or hub id -> jaxlm checkpoint folder (fine-tune with "
                                       "`jaxlm train OUT/config.json`)")
    a.add_argument("src", help="folder with config.json + *.safetensors, or a hub id such as meta-llama/Llama-3.1-8B")
    a.add_argument("out", help="output folder")
    a.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype the weights are stored and trained in (default float32)")
    a.add_argument("--adapter", metavar="PEFT_DIR", help="also import this PEFT LoRA adapter of the model (OUT then "
                   "serves base + adapter, and `jaxlm train OUT/config.json` goes on training the adapter)")
    b = sub.add_parser("to-hf", help="jaxlm run directory or converted checkpoint -> HF folder")
    b.add_argument("path", help="run directory (its latest checkpoint) or converted checkpoint folder")
    b.add_argument("out", help="output folder")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="tensor dtype (default: the weights')")
    b.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    b.add_argument("--adapter-only", action="store_true", help="write a LoRA run's adapter as a PEFT adapter folder "
                   "(adapter_config.json, adapter_model.safetensors) instead of the merged model")
    args = p.parse_args(argv)
    from jaxlm.store import adapters, convert

    if args.direction == "from-hf":
        if args.adapter:  # read before the base is converted: an adapter that does not fit leaves nothing behind
            model = convert.read_hf_config(args.src, args.param_dtype)[2]
            adapters.read_peft(args.adapter, config_lib.Config(model=model))
        out = convert.from_hf(args.src, args.out, args.param_dtype)
        if args.adapter:
            adapters.import_peft(out, args.adapter)
    elif args.adapter_only:
        adapters.write_peft(args.path, args.out, args.dtype)
    else:
        convert.to_hf(args.path, args.out, args.dtype, int(args.shard_gb * 2**30))
    return 0


def cmd_plot(argv: list[str]) -> int:
    from jaxlm.train import plot

    p = argparse.ArgumentParser(prog="jaxlm plot", description="Plot loss, val loss, tokens/s and MFU of runs.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", help="PNG to write (default RUN_DIR/metrics.png for one local run, ./metrics.png for a "
                   "URL, runs.png for several)")
    a = p.parse_args(argv)
    if a.out:
        out = a.out
    elif len(a.run_dirs) == 1:  # beside the metrics of a local run; in the working directory for a URL
        out = "metrics.png" if "://" in a.run_dirs[0] else f"{a.run_dirs[0]}/metrics.png"
    else:
        out = "runs.png"
    print(f"wrote {plot.plot(a.run_dirs, out)}")
    return 0


def cmd_eval(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxlm eval RUN_DIR [key=value ...]\n"
              "       jaxlm eval SRC --tasks T1,T2 [--include-path DIR] [--limit N] [--url URL] [key=value ...]\n\n"
              "Restore the latest checkpoint of a training run (a folder, or an s3:// or gs:// URL), print its\n"
              "train/val loss on the batches training evaluated on, and a sample (training.sample_tokens=0 skips\n"
              "it). Settings override the run's config.json, e.g. model.quantization=int8_weights evaluates and\n"
              "samples with int8-stored weights and prints the float figures beside them.\n"
              "With --tasks: run lm-evaluation-harness tasks (docs/serve.md) against the model through\n"
              "`jaxlm serve` (started here on 127.0.0.1 with serve.*/decode.* settings, or a running one at --url).")
        return 0 if argv else 2
    if any(a == "--tasks" or a.startswith("--tasks=") for a in argv):
        require_extra("jaxlm eval --tasks", "eval", *[] if any(a.startswith("--url") for a in argv) else ["serve"])
        from jaxlm.eval import harness

        return harness.main(argv)
    from jaxlm.eval import heldout

    heldout.evaluate_run(argv[0], config_lib.parse_overrides(argv[1:]))
    return 0


def cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxlm generate", description="Sample text from a run directory (its latest "
                                "checkpoint) or a `jaxlm convert from-hf` folder, with a KV cache; the first "
                                "sample streams as it is generated. Settings are decode.* keys (the prefix may be "
                                "left out): max_new_tokens, temperature, top_k, top_p, seed, cache_length, "
                                "quantize_kv_cache, quantize_weights, stop_tokens, stop_at_eos (docs/generate.md). mesh.* keys "
                                "shard the model over devices (mesh.ici_data=1 mesh.ici_tensor=4: tensor parallel "
                                "on 4).")
    p.add_argument("src", help="run directory or converted checkpoint folder")
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch of prompts)")
    p.add_argument("--prompt-file", action="append", help="file whose text is a prompt (repeatable)")
    p.add_argument("--num-samples", type=int, help="samples per prompt (decode.num_samples)")
    p.add_argument("--chat", action="store_true", help="each prompt is a user message: render it with the model's "
                   "chat template (as `jaxlm prepare chat` renders training data) and generate the reply")
    p.add_argument("--tokenizer", help="tokenizer to use instead of the model's (data.tokenizer; docs/data.md)")
    p.add_argument("--image", action="append", help="an image (a file or a data URL) for every prompt, placed at "
                   "the prompt's <start_of_image> (Llama 4: <|image|>; Qwen-VL: <|image_pad|>) or before its text "
                   "(a model with a vision tower; docs/vision.md)")
    p.add_argument("settings", nargs="*", metavar="key=value")
    a, rest = p.parse_known_args(argv)
    from jaxlm.infer import api, generate

    a.settings += rest  # key=value settings may come before or after the options

    settings = config_lib.parse_overrides(a.settings)
    mesh_settings = {k: settings.pop(k) for k in list(settings) if k.startswith("mesh.")}
    if a.num_samples is not None:
        settings["num_samples"] = a.num_samples
    d = api.decode_config(settings)
    mesh_cfg = config_lib.apply_overrides(config_lib.Config(), mesh_settings).mesh if mesh_settings else None
    prompts = list(a.prompt or [])
    for f in a.prompt_file or []:
        if not Path(f).is_file():
            raise config_lib.ConfigError(f"--prompt-file {f} does not exist")
        prompts.append(Path(f).read_text())
    if not prompts:
        p.error("give a prompt with --prompt TEXT or --prompt-file FILE")
    model = api.load(a.src, mesh_cfg, d.quantize_weights)
    if a.tokenizer:
        model.config = model.config.replace(data=dataclasses.replace(model.config.data, tokenizer=a.tokenizer))
    tok = model.tokenizer()
    if a.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": text}]) for text in prompts]
    m_cfg = model.config.model
    pixels = None
    if a.image:
        if m_cfg.vision is None or d.draft:
            raise config_lib.ConfigError("--image needs a model with a vision tower (model.vision) and no decode.draft")
        bos = [tok.bos_id] if tok.bos_id is not None and not a.chat else []
        ids, pixels = api.image_prompts(model, tok, [t for t in prompts for _ in range(d.num_samples)], a.image, bos)
    else:
        ids = [api.encode_prompt(tok, text, rendered=a.chat) for text in prompts for _ in range(d.num_samples)]
    stop = config_lib.stop_token_ids(d) + (tok.eos_ids if d.stop_at_eos else ())
    if m_cfg.position != "learned" and max(map(len, ids)) + d.max_new_tokens > m_cfg.block_size:
        print(f"note: prompt + max_new_tokens={d.max_new_tokens} run past the {m_cfg.block_size} positions this "
              "model was trained on; text there may degrade", file=sys.stderr)
    streamed: list[int] = []
    shown = [""]

    def on_tokens(tokens_B, live_B):  # stream the first sample, decoding the whole tail so UTF-8 stays whole
        if live_B[0]:
            streamed.append(int(tokens_B[0]))
            text = tok.decode(streamed)
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    print(f"--- sample 1{' of ' + str(len(ids)) if len(ids) > 1 else ''}\n{prompts[0]}", end="", flush=True)
    if d.draft:
        from jaxlm.infer import speculative

        draft = None if d.draft == "mtp" else api.load(d.draft, mesh_cfg)
        out = speculative.generate_speculative(model.params, model.config.model, draft and draft.params,
                                               draft and draft.config.model, ids, d, stop, on_tokens)
    else:
        out = generate.generate(model.params, model.config.model, ids, d, stop, on_tokens, mesh=model.mesh,
                                images=pixels)
    print()
    for i, new in enumerate(out.tokens[1:], start=2):
        print(f"--- sample {i} of {len(ids)}\n{prompts[(i - 1) // d.num_samples]}{tok.decode(new)}")
    n = sum(map(len, out.tokens))
    print(f"--- compile {out.compile_s:.2f} s | prefill {out.prefill_s * 1e3:.1f} ms ({len(ids)} x "
          f"{max(map(len, ids))} tokens) | decode {n} tokens in {out.decode_s:.2f} s = "
          f"{out.decode_tokens_per_s:,.1f} tokens/s"
          + (f" | draft tokens accepted {out.accepted:,} of {out.proposed:,} ({out.acceptance:.1%}), "
             f"{n / max(out.passes, 1):.2f} tokens per pass of the model" if d.draft else ""), file=sys.stderr)
    return 0


def cmd_serve(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxlm serve RUN_DIR_OR_CONVERTED [key=value ...]\n\n"
              "Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,\n"
              "/v1/models, /tokenize, /health, /metrics) with continuous batching. Settings: serve.host\n"
              "(127.0.0.1), serve.port (8000), serve.uds (a unix socket's path: listen there instead),\n"
              "serve.max_slots, serve.max_queue, serve.prefill_chunk (512),\n"
              "serve.prefix_cache (4), serve.decode_steps (8, decode steps per device call), serve.model_name,\n"
              "serve.api_key (or JAXLM_API_KEY), serve.chat_template;\n"
              "decode.* give the sampling defaults and the cache length\n"
              "(decode.cache_length, default model.block_size); mesh.* shard the model (docs/serve.md).")
        return 0 if argv else 2
    require_extra("jaxlm serve", "serve")
    from jaxlm import serve

    return serve.run(argv[0], config_lib.parse_overrides(argv[1:]))


COMMANDS = {"train": cmd_train, "compile": cmd_compile, "prepare": cmd_prepare, "launch": cmd_launch,
            "describe": cmd_describe, "plot": cmd_plot, "convert": cmd_convert, "eval": cmd_eval,
            "generate": cmd_generate, "tokenizer": cmd_tokenizer, "serve": cmd_serve}


def use_huge_pages() -> None:
    """Re-run this command with glibc's transparent-huge-page malloc (needs the variable at process start).
    XLA:CPU allocates each step's scratch buffer with malloc; above glibc's mmap threshold (32 MB at most)
    every step maps fresh memory and takes tens of thousands of page faults, a third of a small model's
    step time. Huge pages cut those faults about fifty-fold. JAXLM_NO_REEXEC=1 turns this off."""
    if (sys.platform != "linux" or "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", "")
            or os.environ.get("JAXLM_NO_REEXEC")):
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1"]))
    env = dict(os.environ, GLIBC_TUNABLES=tunables, JAXLM_NO_REEXEC="1")
    os.execve(sys.executable, [sys.executable, "-m", "jaxlm.cli", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        use_huge_pages()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: jaxlm {" + ",".join(COMMANDS) + "} ...\n\n"
              "  train PRESET_OR_FILE [key=value ...]   train or resume a model (jaxlm train --help)\n"
              "  compile PRESET_OR_FILE compile.topology=NAME [...]  compile the train step ahead of time for a\n"
              "                                         TPU/GPU/CPU target; memory report (jaxlm compile --help)\n"
              "  prepare DATASET [...]                  corpus -> token files (jaxlm prepare --help)\n"
              "  prepare corpus|chat|preference INPUT... --tokenizer T --out DIR   any corpus, chat data or preference\n"
              "                                         pairs -> token shards\n"
              "  tokenizer train INPUT... --vocab-size N --out DIR   train a byte-level BPE tokenizer\n"
              "  launch --processes N -- train ...      one job in N local processes (jaxlm launch --help)\n"
              "  launch --scheduler slurm|kubernetes|tpu-vm ... -- train ...  the same through a cluster's scheduler\n"
              "  describe SLICE | PRESET [key=value]   a TPU slice's workers and chips (v5e-256), or a model's\n"
              "                                         parameters (total, active), layers, FLOPs, KV cache\n"
              "  plot RUN_DIR [RUN_DIR ...]             loss and throughput curves -> PNG (jaxlm plot --help)\n"
              "  convert from-hf|to-hf SRC OUT          Hugging Face checkpoints in and out (jaxlm convert --help)\n"
              "  eval RUN_DIR [key=value ...]           losses and a sample of a trained run, or lm-eval tasks\n"
              "                                         with --tasks (jaxlm eval --help)\n"
              "  generate SRC --prompt TEXT [k=v ...]   sample text with a KV cache (jaxlm generate --help)\n"
              "  serve SRC [key=value ...]              OpenAI-compatible HTTP server (jaxlm serve --help)")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    if argv[0] != "launch":
        from jaxlm.launch.local import watch_peers
        watch_peers()  # under `jaxlm launch`: leave when another process of the job has failed
    try:
        return COMMANDS[argv[0]](argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    except RuntimeError as e:
        from jaxlm.launch import distributed
        if (lost := distributed.lost_peer(e)) is not None:
            from jaxlm.launch.local import leave
            leave(lost)
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        return 0


if __name__ == "__main__":
    sys.exit(main())
