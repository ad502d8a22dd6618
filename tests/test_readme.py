"""The README walked top to bottom in an empty folder, as a new user with a fresh clone would: every `jaxlm` command
of its shell blocks (and the `$ ` lines of its examples) runs as printed, at tiny sizes, and exits as it should; the
printed outputs of its examples are the program's own.

How a command runs here, against how it is printed:
- settings are appended to it (TINY, FINETUNE): they make it small and fast and win over the README's own (the last
  `key=value` of a key counts); a trailing `...` (the README's "your other settings") is replaced by them;
- the files and folders a command names exist first, made by `setup` in the walk's folder (path/to/input.txt, a
  tiny random Llama at ./Llama-3.1-8B with a byte-level tokenizer, the prepared folders data/mydata, data/sft and
  data/pairs, math.jsonl, an lm-eval task in tasks/), and the placeholders RUN_DIR_OR_CONVERTED and outputs/RUN
  name the quickstart's run (trained first, as `make quickstart` does);
- the two first training examples save to outputs/run1 and outputs/run2 (the runs `jaxlm plot` draws), the unix
  socket is in the walk's folder (/run may not be writable), `jaxlm serve` runs in its own process (with
  serve.max_slots=4) until it answers /health, on a free port;
- NOT_RUN lists the commands that are not run, each with its reason (the network, a 7B compile, the installs).
A command added to the README fails this test until it is placed in one of these (COMMANDS or NOT_RUN)."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import require

transformers = require("transformers", "hf")
require("fastapi")
require("lm_eval")

from jaxlm import cli  # noqa: E402
from jaxlm.data import tokenizer as tokenizer_lib  # noqa: E402
from jaxlm.store import convert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.block_size=32", "training.batch_size=8",
        "training.steps=2", "training.eval_interval=2", "training.eval_batches=1", "training.sample_tokens=0",
        "logging.progress=false", "logging.tensorboard=false", "checkpoint.interval=2"]
# A converted model keeps its shape: fine-tuning it changes the run's length alone.
FINETUNE = ["model.block_size=32", "training.batch_size=8", "training.steps=2", "training.eval_interval=2",
            "training.eval_batches=1", "training.sample_tokens=0", "logging.progress=false",
            "logging.tensorboard=false", "checkpoint.interval=2"]
QUICKSTART = ["jaxlm", "train", "quickstart", "run_dir=outputs/RUN", *TINY, "model.block_size=64",
              "training.sample_tokens=16"]

NOT_RUN = {
    "make quickstart": "installs a venv; runs `jaxlm train quickstart`, which this walk runs first at a tiny size",
    "make test": "the test suite itself",
    "jaxlm train PRESET_OR_FILE [key=value ...]": "the command's form, not a command",
    "pip install 'jaxlm[tpu]'": "an install (make test has the tpu extra)",
    "jaxlm train openwebtext diagnostics.collect_stack_trace=true diagnostics.stack_trace_to_file=true "
    "diagnostics.hang_timeout_seconds=1800 diagnostics.hang_exit=true": "OpenWebText needs the network",
    "jaxlm prepare openwebtext": "needs the network",
    "jaxlm compile llama2-7b compile.topology=v5e-256 mesh.ici_data=1 mesh.ici_fsdp=-1 "
    "training.per_device_batch_size=4": "a minute of compiling a 7B model (tests/test_aot.py compiles for a TPU slice)",
}

# README command -> (settings appended, exit status). Everything here runs, in this order of the README. Runs that
# no later command reads save no checkpoint (NO_SAVE: a save costs seconds here).
NO_SAVE = ["checkpoint.enabled=false"]
TRAIN, FT = TINY, FINETUNE
COMMANDS = {
    "jaxlm generate outputs/RUN --prompt \"def \"": ([], 0),
    "jaxlm serve outputs/RUN": ([], "serve"),
    "jaxlm eval outputs/RUN": ([], 0),
    "jaxlm convert to-hf outputs/RUN out/hf": ([], 0),
    "jaxlm train --help": ([], 0),
    "jaxlm train shakespeare_char_cpu data.input=path/to/input.txt": ([*TRAIN, "run_dir=outputs/run1"], 0),
    "jaxlm train shakespeare_char model.n_layers=4 training.steps=100 optimizer.lr=3e-4":
        ([*TRAIN, "run_dir=outputs/run2"], 0),
    "jaxlm train my_run.yaml training.batch_size=32": ([*TRAIN, "training.batch_size=32", *NO_SAVE], 0),
    "jaxlm train quickstart model.n_layer=4": ([], 2),
    "jaxlm train quickstart model.n_heads=5": ([], 2),
    "jaxlm train shakespeare_char profiler=xplane": ([*TRAIN, "training.steps=6", *NO_SAVE], 0),
    "jaxlm train shakespeare_char logging.wandb=true": ([*TRAIN, *NO_SAVE], 0),
    "jaxlm plot outputs/run1 outputs/run2": ([], 0),
    "jaxlm convert from-hf ./Llama-3.1-8B out/llama31": ([], 0),
    "jaxlm train out/llama31/config.json data.dataset=mydata": ([*FT, *NO_SAVE], 0),
    "jaxlm convert to-hf outputs/run1 out/hf": ([], 0),
    "jaxlm train out/llama31/config.json data.dir=data/sft lora.rank=16 lora.alpha=32 run_dir=runs/sft": (FT, 0),
    "jaxlm train out/llama31/config.json data.dir=data/sft lora.rank=16 lora.base_quantization=nf4":
        ([*FT, "run_dir=runs/qlora", *NO_SAVE], 0),
    "jaxlm train runs/sft/config.json checkpoint.init_from=runs/sft data.dir=data/pairs training.objective=dpo":
        ([*FT, "run_dir=runs/dpo", *NO_SAVE], 0),
    "jaxlm train runs/sft/config.json checkpoint.init_from=runs/sft training.objective=grpo data.prompts=math.jsonl "
    "grpo.reward=jaxlm.rewards:exact_answer grpo.group_size=8": (
        [*FT, "run_dir=runs/grpo", "grpo.max_completion_tokens=4", "training.eval_interval=0", *NO_SAVE], 0),
    "jaxlm convert to-hf runs/sft out/peft --adapter-only": ([], 0),
    "jaxlm convert from-hf ./Llama-3.1-8B out/l31 --adapter ./peft-adapter": ([], 0),
    "jaxlm generate RUN_DIR_OR_CONVERTED --prompt \"def \" max_new_tokens=100 temperature=0.7 top_p=0.9":
        (["max_new_tokens=20"], 0),
    "jaxlm serve RUN_DIR_OR_CONVERTED serve.port=8000 serve.max_slots=16": ([], "serve"),
    "jaxlm serve RUN_DIR_OR_CONVERTED serve.uds=/run/jaxlm.sock": ([], "serve"),
    "jaxlm eval RUN_DIR_OR_CONVERTED --tasks mytask --include-path tasks/": (["--limit", "2", "serve.max_slots=4"], 0),
    "jaxlm compile shakespeare_char_cpu compile.topology=cpu-8 compile.output=step.jaxlm": (TRAIN, 0),
    "jaxlm train shakespeare_char_cpu compile.load=step.jaxlm": ([*TRAIN, *NO_SAVE], 0),
    "jaxlm prepare shakespeare_char --input path/to/input.txt": ([], 0),
    "jaxlm prepare text notes.txt more.txt --out data/mytext --vocab char": ([], 0),
    "jaxlm prepare python_stdlib": ([], 0),
    "jaxlm train shakespeare_char_cpu model.quantization=int8 run_dir=outputs/int8": (TRAIN, 0),
    "jaxlm eval outputs/int8 model.quantization=int8_weights": ([], 0),
}


def readme_commands(text: str) -> list[str]:
    """The commands of the README's bash blocks and the `$ ` lines of its other blocks, in order: continuation lines
    joined, comments and a trailing `...` dropped."""
    out = []
    for fence, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if fence not in ("bash", ""):
            continue
        body = body.replace("\\\n", " ")
        for line in body.splitlines():
            if fence == "":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = re.sub(r"\s+#.*$", "", line).strip()
            line = re.sub(r"\s*\.\.\.$", "", line)
            if line:
                out.append(re.sub(r"\s+", " ", line))
    return out


def test_every_readme_command_is_walked_or_says_why_not():
    # cheap, and in `make test`'s every run: the README and this walk name the same commands
    got = readme_commands((ROOT / "README.md").read_text())
    placed = set(COMMANDS) | set(NOT_RUN)
    assert [c for c in got if c not in placed] == [], "README commands this walk does not run nor explain"
    assert [c for c in placed if c not in got] == [], "commands of this walk that the README no longer has"


def expected_errors(text: str) -> dict[str, str]:
    """The README's `$ command` examples -> the line printed after each."""
    lines = text.splitlines()
    return {lines[i][2:].strip(): lines[i + 1] for i in range(len(lines) - 1) if lines[i].startswith("$ jaxlm")}


def setup(folder: Path, shakespeare: Path) -> None:
    """What the README's commands name, made beside them (the module docstring)."""
    (folder / "path" / "to").mkdir(parents=True)
    shutil.copyfile(shakespeare, folder / "path" / "to" / "input.txt")
    text = shakespeare.read_text()
    (folder / "notes.txt").write_text(text[:20_000])
    (folder / "more.txt").write_text(text[20_000:40_000])
    (folder / "my_run.yaml").write_text("base: shakespeare_char\nmodel:\n  n_layers: 1\ntraining:\n  steps: 2\n")
    hf = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(hf).save_pretrained(folder / "Llama-3.1-8B")
    for name, body in convert.hf_tokenizer_files(tokenizer_lib.ByteTokenizer()).items():
        (folder / "Llama-3.1-8B" / name).write_text(body)
    (folder / "math.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                                               for a in range(16)))
    (folder / "tasks").mkdir()
    (folder / "tasks" / "mytask.jsonl").write_text("".join(json.dumps({"question": f"def f{i}(", "answer": "x"})
                                                           + "\n" for i in range(4)))
    (folder / "tasks" / "mytask.yaml").write_text(
        "task: mytask\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: tasks/mytask.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: "
        "\"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\nmetric_list:\n"
        "  - metric: exact_match\n")


# Made before the command that first needs them, with the converted model's tokenizer (out/llama31's).
PREPARE = "--per-line --val-fraction 0.05 --workers 0 --no-progress"
BEFORE = {
    "jaxlm train out/llama31/config.json data.dataset=mydata": [
        f"jaxlm prepare corpus notes.txt --tokenizer out/llama31 --out data/mydata {PREPARE}",
        f"jaxlm prepare corpus notes.txt --tokenizer out/llama31 --out data/sft {PREPARE}"],
    "jaxlm train runs/sft/config.json checkpoint.init_from=runs/sft data.dir=data/pairs training.objective=dpo": [
        "jaxlm prepare preference pairs.jsonl --tokenizer out/llama31 --out data/pairs --max-tokens 32 "
        "--val-fraction 0.2 --workers 0 --no-progress"],
    "jaxlm convert from-hf ./Llama-3.1-8B out/l31 --adapter ./peft-adapter": ["cp -r out/peft peft-adapter"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_healthy(argv: list[str], folder: Path) -> None:
    """`jaxlm serve ...` in its own process until /health answers, then SIGTERM: it must exit as a server stopped
    by it does (143, after uvicorn's graceful shutdown)."""
    import httpx

    uds = next((a.split("=", 1)[1] for a in argv if a.startswith("serve.uds=")), None)
    port = free_port()
    argv = [a if not a.startswith("serve.port=") else f"serve.port={port}" for a in argv]
    if uds is not None:
        argv = [a if not a.startswith("serve.uds=") else f"serve.uds={folder / 'jaxlm.sock'}" for a in argv]
    elif not any(a.startswith("serve.port=") for a in argv):
        argv.append(f"serve.port={port}")
    proc = subprocess.Popen([sys.executable, "-m", "jaxlm.cli", *argv[1:], "serve.max_slots=4"], cwd=folder,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAXLM_NO_REEXEC="1"))
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("listening on"):
                break
        assert any(l.startswith("jaxlm serve: compiling") for l in lines), lines
        transport = httpx.HTTPTransport(uds=str(folder / "jaxlm.sock")) if uds else None
        with httpx.Client(transport=transport, base_url="http://localhost" if uds else f"http://127.0.0.1:{port}",
                          timeout=30) as c:
            deadline = time.monotonic() + 30  # "listening on" comes as uvicorn binds: a moment before it accepts
            while True:
                try:
                    health = c.get("/health")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert health.json() == {"status": "ok"}
            assert c.get("/v1/models").json()["data"][0]["id"] == "RUN"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM  # stopped, after uvicorn's graceful shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.in_ci
def test_readme_commands_run_as_printed(tmp_path, monkeypatch, capsys, shakespeare_file):
    # 33 commands; about 5 minutes on a 2-core machine shared with other work (load ~8), its own timings printed
    readme = (ROOT / "README.md").read_text()
    errors = expected_errors(readme)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    setup(tmp_path, shakespeare_file)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}:", "chosen": " yes", "rejected": " no"})
                                                  + "\n" for i in range(24)))

    def run(argv: list[str]) -> tuple[int, str]:
        capsys.readouterr()
        code = cli.main(argv[1:])
        out, err = capsys.readouterr()
        run.out = out
        return code, err

    code, err = run(QUICKSTART)  # `make quickstart`, whose run the README's next commands use
    assert code == 0, err
    out = run.out
    assert out.strip().splitlines()[-1].startswith("saved in outputs/RUN; next: jaxlm generate outputs/RUN --prompt "
                                                   "'def ' | jaxlm serve outputs/RUN | jaxlm eval outputs/RUN"), out
    timings = {}
    for command in readme_commands(readme):
        if command in NOT_RUN:
            continue
        extra, want = COMMANDS[command]
        for step in BEFORE.get(command, []):
            if step.startswith("cp "):
                shutil.copytree(*shlex.split(step)[2:])
            else:
                code, err = run(shlex.split(step))
                assert code == 0, (step, err)
        argv = shlex.split(command.replace("RUN_DIR_OR_CONVERTED", "outputs/RUN")) + extra
        started = time.perf_counter()
        if want == "serve":
            serve_until_healthy(argv, tmp_path)
        else:
            code, err = run(argv)
            assert code == want, (command, err[-3000:])
            if command in errors:
                assert err.strip().splitlines()[-1] == errors[command], (command, err)
        timings[command] = round(time.perf_counter() - started, 1)
    print(json.dumps(timings, indent=1))
