"""The run's settings: a frozen dataclass per section (`data.*`, `optimizer.*`, `training.*`, `mesh.*`, ...,
`serve.*`) whose fields carry their help and range rules, the Config that holds them, and every key as users
write it (all_keys, spelled)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxlm.config.model_schema import ModelConfig
from jaxlm.config.rules import Rule, at_least, between, positive, setting as _f

@dataclass(frozen=True)
class DataConfig:
    dataset: str = _f("shakespeare_char", "dataset name: shakespeare_char, python_stdlib, openwebtext, or a prepared folder's name")
    dir: str | None = _f(None, "prepared folder (meta.json and its shards, or train.bin and val.bin): a path, or a URL "
                               "(gs://, s3://, any fsspec filesystem) streamed without a local copy "
                               "(docs/scaling.md); None = data/<dataset>")
    input: str | None = _f(None, "local text file to prepare the dataset from when the folder is missing (no download)")
    tokenizer: str | None = _f(None, "tokenizer for text in and out (byte, a tiktoken encoding or .tiktoken file, a "
                                     "SentencePiece .model, a tokenizer.json or a folder holding one, a hub id); "
                                     "None = the model's tokenizer/ folder, else the dataset's meta.json "
                                     "(docs/data.md); a dataset prepared with another tokenizer is refused")
    packing: bool = _f(False, "rows of whole documents back to back, each with its own segment id and positions "
                              "from 0 (attention never crosses a document); false = random windows of the corpus. "
                              "Needs a dataset with document boundaries (`jaxlm prepare`, format 2)")
    images_per_row: int = _f(0, "image data (docs/vision.md): image slots of each row of a batch, the tower's "
                                "work per row; 0 = the most images one conversation (or preference pair) has, or 1 "
                                "for `jaxlm compile` without data. With data.packing a row takes conversations "
                                "while their images fit", rule=at_least(0))
    mixture: str | None = _f(None, "train on several prepared folders sharing one tokenizer, each row drawn from one "
                                   "of them by weight: 'dirA:0.7,dirB:0.3' (replaces data.dir/data.dataset)")
    prompts: str | None = _f(None, "training.objective=grpo: a jsonl file of prompts, each a record with `prompt` "
                                   "text or chat `messages`; its other fields (e.g. `answer`) go to the rewards")
    eval_prompts: str | None = _f(None, "training.objective=grpo: held-out prompts (jsonl as data.prompts) answered "
                                        "greedily at each evaluation; their mean reward is eval_reward")
    loss_mask: Literal["auto", "on", "off"] = _f(
        "auto", "train only on the targets the dataset's loss mask marks (chat data: the assistant's tokens): "
                "auto = when the dataset has a mask, on = require one, off = train on every token")
    read_ahead: int = _f(2, "data.dir at a URL: batches planned ahead and read by background threads while the "
                            "steps run; 0 = each batch read when its step comes", rule=between("[0, 64]"))
    cache_mb: int = _f(256, "data.dir at a URL: MiB of fetched blocks of the shards kept in memory (least recently "
                            "used out first); no shard is downloaded whole", rule=between("[1, 1048576]"))
    block_kb: int = _f(64, "data.dir at a URL: KiB of one ranged read of a shard (each read fetches the blocks its "
                           "rows fall in)", rule=between("[4, 1024]"))


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "muon"] = _f(
        "adamw", "adamw: AdamW on every weight; muon: Muon (orthogonalized momentum) on the hidden matrices of the "
                 "layers (attention, MLP, experts, router; per layer and per expert) and AdamW on embeddings, "
                 "output layer, norms and biases (optim.py; a LoRA run's adapters always train with AdamW)")
    lr: float = _f(1e-3, "peak learning rate (of every weight with adamw; of the AdamW group with muon)",
                   rule=positive())
    min_lr: float = _f(1e-4, "learning rate at the end of the decay (the muon group's is scaled alike)")
    warmup_steps: int = _f(100, "linear warmup steps from 0 to lr", rule=at_least(0))
    decay_steps: int | None = _f(None, "step at which the decay reaches min_lr; None = training.steps")
    schedule: Literal["cosine", "wsd", "linear", "constant"] = _f(
        "cosine", "after warmup: cosine or linear decay to min_lr at decay_steps; wsd = warmup-stable-decay: lr "
                  "held until the cooldown (cooldown_steps or cooldown_fraction) before decay_steps, then "
                  "cooldown_shape down to min_lr, so a run extended with a larger training.steps before its "
                  "cooldown starts continues exactly; constant = lr after warmup")
    cooldown_fraction: float = _f(0.2, "schedule=wsd: share of the steps up to decay_steps spent cooling down",
                                  rule=between("[0, 1]"))
    cooldown_steps: int | None = _f(None, "schedule=wsd: length of the cooldown in steps; None = cooldown_fraction",
                                    rule=at_least(0, "or None: cooldown_fraction"))
    cooldown_shape: Literal["linear", "cosine", "sqrt"] = _f(
        "linear", "schedule=wsd: shape of the cooldown from lr to min_lr: linear, cosine, or sqrt "
                  "(1 - sqrt(progress): most of the drop early; Hagele et al. 2024)")
    beta1: float = _f(0.9, "AdamW beta1", rule=between("[0, 1)"))
    beta2: float = _f(0.95, "AdamW beta2", rule=between("[0, 1)"))
    eps: float = _f(1e-8, "AdamW epsilon", rule=positive())
    weight_decay: float = _f(0.1, "weight decay (see weight_decay_mode); of the AdamW group with muon",
                             rule=at_least(0))
    weight_decay_mode: Literal["coupled", "independent"] = _f(
        "coupled",
        "coupled: decay multiplied by the scheduled lr (torch AdamW); independent: decay follows the "
        "schedule's shape but not the peak lr (midGPT)",
    )
    decay_embeddings: bool = _f(True, "apply weight decay to embedding tables (norms and biases never decay)")
    grad_clip: float = _f(1.0, "global gradient-norm clipping threshold; 0 disables", rule=at_least(0))
    muon_lr: float | None = _f(None, "optimizer.name=muon: peak learning rate of the Muon group; None = lr (the "
                                     "update is scaled to an RMS of muon_rms, so both groups can share one rate)",
                               rule=positive())
    muon_weight_decay: float | None = _f(None, "optimizer.name=muon: the Muon group's decoupled weight decay; "
                                               "None = weight_decay", rule=at_least(0))
    muon_momentum: float = _f(0.95, "optimizer.name=muon: momentum of the gradient average Muon orthogonalizes",
                              rule=between("[0, 1)"))
    muon_nesterov: bool = _f(True, "optimizer.name=muon: Nesterov momentum (orthogonalize g + momentum * m)")
    muon_ns_steps: int = _f(5, "optimizer.name=muon: Newton-Schulz iterations per update", rule=positive())
    muon_rms: float = _f(0.2, "optimizer.name=muon: each orthogonalized update is scaled by muon_rms * "
                              "sqrt(max(fan_in, fan_out)), giving it about that RMS (AdamW's typical 0.2-0.4: "
                              "Moonlight); 0 = Keller Jordan's scale max(1, fan_out / fan_in) ** 0.5 instead",
                         rule=at_least(0, "0 = off"))
    qk_clip: float = _f(0.0, "MuonClip (Kimi K2): after each update, a head whose largest attention logit in the "
                             "step exceeded this threshold has its query and key projections scaled so it would "
                             "not (per head; with QK-norm, the layer's shared norm scales by its worst head); the "
                             "largest logit of each layer is logged as attn_logit_max/<layer>. 0 = off (Kimi: 100)",
                        rule=at_least(0, "0 = off"))


SPIKE = Rule(lambda v: v == 0 or 1 < v < math.inf, "0 (off) or a finite ratio > 1")
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "orpo")


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = _f(5000, "optimizer steps to train for", rule=positive())
    objective: Literal["next_token", "dpo", "ipo", "orpo", "grpo"] = _f(
        "next_token", "what the train step minimizes (objectives.py): next_token = cross-entropy of the next token "
                      "(pretraining, and SFT with loss masks); dpo, ipo, orpo = preference tuning on data from "
                      "`jaxlm prepare preference` (dpo.*, orpo.* settings; docs/preference.md); grpo = reinforcement "
                      "learning on rewarded rollouts (grpo.*, data.prompts; docs/rl.md)")
    batch_size: int = _f(64, "sequences per micro-batch across all devices (the global batch); "
                             "ignored when per_device_batch_size is set", rule=positive())
    per_device_batch_size: float | None = _f(None, "sequences per device per micro-batch; the global batch is this "
                                                   "times the device count (may be fractional when some mesh axes "
                                                   "do not split the batch)", rule=positive())
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step", rule=positive())
    freeze_vision: bool = _f(True, "a vision-language model's vision tower and projector (model.vision) get no "
                                   "gradient, no update and no optimizer state; false trains them with the rest "
                                   "(docs/vision.md, \"Training with images\")")
    pipeline_microbatches: int = _f(0, "with mesh stages (mesh.ici_stage x mesh.dcn_stage > 1): pieces each "
                                       "accumulated micro-batch is cut into to flow through the pipeline; "
                                       "0 = the number of stages (docs/scaling.md)", rule=at_least(0))
    pipeline_repeats: int = _f(1, "circular pipeline: times each micro-batch loops through the stages, each "
                                  "stage running 1/(stages x repeats) of the layers per pass; 1 = GPipe",
                               rule=positive())
    eval_interval: int = _f(250, "evaluate train/val loss every this many steps (and at the end); 0 = only at the end",
                            rule=at_least(0))
    eval_batches: int = _f(20, "fixed held-out batches per split in each evaluation", rule=positive())
    log_interval: int = _f(10, "steps between metric flushes (every step is still recorded)", rule=positive())
    sample_tokens: int = _f(200, "tokens sampled at the end of training; 0 = no sample", rule=at_least(0))
    sample_prompt: str = _f("\n", "prompt for the end-of-training sample")
    sample_temperature: float = _f(0.8, "sampling temperature for the end-of-training sample", rule=at_least(0))
    sample_top_k: int = _f(200, "top-k for the end-of-training sample; 0 = off", rule=at_least(0))
    on_nonfinite: Literal["skip", "stop"] = _f(
        "skip", "a step whose loss or gradient norm is NaN/inf is never applied; skip: go on with the next batch "
                "(up to max_consecutive_skips in a row), stop: end the run with an error")
    max_consecutive_skips: int = _f(20, "with on_nonfinite=skip, end the run when more steps than this in a row "
                                        "are not finite", rule=at_least(0))
    spike_threshold: float = _f(0.0, "skip the update of a step whose loss exceeds this multiple of the running "
                                     "average loss (about the last 100 steps); 0 = off, else > 1", rule=SPIKE)


LORA_TARGETS = ("q", "k", "v", "o", "up", "gate", "down")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = _f(0, "LoRA adapter rank; 0 = off (every weight trains). With a rank only the adapters train: the "
                      "base weights (checkpoint.init_from) are frozen, get no gradient and no optimizer state, and "
                      "checkpoints hold the adapters (docs/finetune.md)", rule=at_least(0, "0 = off"))
    alpha: float = _f(16.0, "adapters add (alpha / rank) * x A B to each adapted projection", rule=positive())
    dropout: float = _f(0.0, "dropout on each adapter's input during training", rule=between("[0, 1)"))
    targets: str = _f("q,k,v,o,up,gate,down", "comma-separated weights that get adapters: q, k, v, o (attention; "
                                              "Hugging Face q_proj, k_proj, v_proj, o_proj) and up, gate, down "
                                              "(dense MLP; up_proj, gate_proj, down_proj); experts are not adapted")
    base_quantization: Literal["none", "int8", "nf4"] = _f(
        "none", "QLoRA: keep the frozen base's attention and dense MLP weights on the device as int8 (one scale "
                "per output channel) or 4-bit NormalFloat (blocks of 64, double-quantized scales), dequantized "
                "layer by layer in the matmul; adapters and compute stay in their own dtypes")


@dataclass(frozen=True)
class DpoConfig:
    beta: float = _f(0.1, "training.objective=dpo|ipo: how far the policy may move from the reference model (the KL "
                          "weight beta; IPO's tau), as TRL's DPOConfig.beta", rule=positive())
    label_smoothing: float = _f(0.0, "training.objective=dpo: the probability that a pair's preference is flipped "
                                     "(conservative DPO), in [0, 0.5); 0 = plain DPO",
                                rule=between("[0, 0.5)", "the probability that a preference label is wrong"))


@dataclass(frozen=True)
class OrpoConfig:
    # `lambda` is a Python keyword: the field is lambda_, and users write orpo.lambda (ALIASES)
    lambda_: float = _f(0.1, "training.objective=orpo: weight of the odds-ratio term beside the chosen reply's "
                             "negative log-likelihood (the ORPO paper's lambda; TRL's ORPOConfig.beta)",
                        rule=at_least(0))


@dataclass(frozen=True)
class GrpoConfig:
    group_size: int = _f(8, "completions sampled per prompt; advantages compare each with its group's mean",
                         rule=positive())
    max_completion_tokens: int = _f(256, "tokens a completion may take; it also stops at the tokenizer's EOS",
                                    rule=positive())
    temperature: float = _f(1.0, "sampling temperature of the rollouts (the loss's log-probabilities use it too)",
                            rule=positive("rollouts are sampled"))
    top_p: float = _f(1.0, "nucleus sampling of the rollouts; 1 = off", rule=between("(0, 1]", "1 = off"))
    top_k: int = _f(0, "top-k sampling of the rollouts; 0 = off", rule=at_least(0, "0 = off"))
    beta: float = _f(0.0, "weight of the KL penalty to the reference model (k3 estimator); 0 drops the reference "
                          "and its forward pass entirely", rule=at_least(0, "0 = no reference model"))
    epsilon: float = _f(0.2, "the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]", rule=between("(0, 1)"))
    epsilon_high: float | None = _f(None, "upper clip (DAPO's asymmetric clip, e.g. 0.28); None = epsilon",
                                    rule=positive("or None: grpo.epsilon"))
    iterations: int = _f(1, "policy updates per batch of rollouts (mu); the old policy's log-probabilities are "
                            "computed once per batch when > 1, and with 1 the ratio is exactly 1", rule=positive())
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = _f(
        "dapo", "how token losses are averaged: grpo = each sequence's mean, then the mean over sequences; bnpo = "
                "over the micro-batch's completion tokens; dr_grpo = over sequences x max_completion_tokens (Dr. "
                "GRPO's constant); dapo = over all completion tokens of the step")
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "divide advantages (reward minus its group's mean) by the group's reward std, the batch's, or "
                 "nothing (Dr. GRPO)")
    reward: str = _f("", "reward functions, comma-separated MODULE:FUNCTION (MODULE a dotted name or a .py file), "
                         "e.g. jaxlm.rewards:exact_answer,my_rewards.py:concise; each is called with prompts, "
                         "completions, completion_ids and the records' other fields, and returns a float each")
    reward_weights: str = _f("", "comma-separated weights of the reward functions; '' = 1 each")
    mask_truncated: bool = _f(False, "leave completions cut at max_completion_tokens out of the loss")
    log_completions: int = _f(10, "every this many steps, write the rollouts' prompts, completions and rewards to "
                                  "<run_dir>/completions.jsonl; 0 = off", rule=at_least(0, "0 = off"))


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = _f(1000, "save every this many steps (and at the end); 0 = only at the end", rule=at_least(0))
    keep: int = _f(3, "checkpoints kept on disk", rule=positive())
    enabled: bool = _f(True, "write checkpoints at all")
    async_save: bool = _f(True, "write checkpoints in the background while training continues")
    on_error: Literal["stop", "continue"] = _f("stop", "when a save fails (read-only or full disk): stop the run "
                                                       "with an error, or warn and try again at the next interval")
    save_on_preemption: bool = _f(True, "on SIGTERM or SIGINT, all processes agree on a step, save it, flush "
                                        "the logs and exit 0 (a second SIGINT aborts)")
    init_from: str | None = _f(None, "start from these weights (a `jaxlm convert from-hf` folder or a run directory) "
                                     "with a fresh optimizer, when run_dir holds no checkpoint yet")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = _f(True, "write TensorBoard event files to the run directory")
    progress: bool = _f(True, "show a progress bar")
    wandb: bool = _f(False, "log metrics to Weights & Biases (pip install 'jaxlm[wandb]'; WANDB_MODE=offline works)")
    wandb_project: str = _f("jaxlm", "W&B project")
    wandb_entity: str | None = _f(None, "W&B entity (team or user); None = your default")
    wandb_run_name: str | None = _f(None, "W&B run name; None = the run directory's name")


MESH_AXES = ("data", "stage", "fsdp", "expert", "sequence", "tensor")
DEVICES = Rule(lambda v: v >= 1 or v == -1, "a positive device count or -1 (fill)")


@dataclass(frozen=True)
class MeshConfig:
    ici_data: int = _f(-1, "data-parallel devices within a slice (or a host); -1 = all that remain", rule=DEVICES)
    ici_fsdp: int = _f(1, "FSDP devices within a slice: shard params, grads and optimizer state; -1 = fill",
                       rule=DEVICES)
    ici_tensor: int = _f(1, "tensor-parallel devices within a slice: shard heads and MLP width; -1 = fill",
                         rule=DEVICES)
    ici_sequence: int = _f(1, "sequence-parallel devices within a slice: shard activations along length; -1 = fill",
                           rule=DEVICES)
    ici_expert: int = _f(1, "expert-parallel devices within a slice: shard MoE experts; -1 = fill", rule=DEVICES)
    ici_stage: int = _f(1, "stage devices within a slice: shard the stacked layers; -1 = fill", rule=DEVICES)
    dcn_data: int = _f(1, "data-parallel slices (or hosts) across the data-center network; -1 = fill", rule=DEVICES)
    dcn_fsdp: int = _f(1, "FSDP across slices; -1 = fill", rule=DEVICES)
    dcn_tensor: int = _f(1, "tensor parallelism across slices (rarely useful); -1 = fill", rule=DEVICES)
    dcn_sequence: int = _f(1, "sequence parallelism across slices; -1 = fill", rule=DEVICES)
    dcn_expert: int = _f(1, "expert parallelism across slices; -1 = fill", rule=DEVICES)
    dcn_stage: int = _f(1, "stages across slices; -1 = fill", rule=DEVICES)
    rules: str = _f("", "overrides of the logical-axis rules, e.g. 'param.embed=fsdp+sequence;act.length=' "
                        "(param./act. + logical axis = mesh axes joined by +, empty = replicated)")


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = _f(None, "host:port of process 0 for jax.distributed; None = single process "
                                              "unless JAXLM_COORDINATOR is set (by `jaxlm launch`)")
    num_processes: int | None = _f(None, "processes in the job (with coordinator_address)", rule=positive())
    process_id: int | None = _f(None, "this process's index (with coordinator_address)", rule=at_least(0))
    auto: bool = _f(False, "let JAX detect the cluster (TPU pods, Slurm, Open MPI, Kubernetes)")


@dataclass(frozen=True)
class DiagnosticsConfig:
    collect_stack_trace: bool = _f(False, "dump every thread's Python stack every stack_trace_interval_seconds")
    stack_trace_interval_seconds: float = _f(600.0, "seconds between stack dumps", rule=positive())
    stack_trace_to_file: bool = _f(False, "append the dumps to <run_dir>/debugging/stack_trace_<process>.txt instead of the console")
    hang_timeout_seconds: float = _f(0.0, "report a hang (stacks + a log line) when no step finishes for this long "
                                          "after the first; 0 = off", rule=at_least(0, "0 = off"))
    hang_exit: bool = _f(False, "after reporting a hang, exit with status 75 so a scheduler restarts the job from its last checkpoint")


PORT_OR_OFF = Rule(lambda v: 0 <= v <= 65535, "a TCP port in 1-65535, or 0 (off)")


@dataclass(frozen=True)
class ProfilerConfig:
    mode: Literal["none", "xplane"] = _f("none", "xplane: trace profiler.steps steps to <run_dir>/profile (TensorBoard/xprof); `profiler=xplane` for short")
    skip_steps: int = _f(3, "steps run after the (re)start before tracing begins; the first one compiles",
                         rule=at_least(0))
    steps: int = _f(5, "steps traced", rule=positive())
    port: int = _f(0, "serve jax.profiler on this port for on-demand capture from TensorBoard/xprof; 0 = off",
                   rule=PORT_OR_OFF)


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = _f(200, "tokens generated per sample at most (fewer when a stop token comes first)",
                             rule=positive())
    temperature: float = _f(0.8, "softmax temperature; 0 = greedy", rule=at_least(0, "0 = greedy"))
    top_k: int = _f(0, "sample only among the k most likely tokens; 0 = off", rule=at_least(0, "0 = off"))
    top_p: float = _f(1.0, "sample only from the smallest set of tokens whose probability reaches top_p "
                           "(nucleus); 1 = off", rule=between("(0, 1]", "1 = off"))
    seed: int = _f(0, "sampling seed: the same seed, prompt and settings give the same text", rule=at_least(0))
    num_samples: int = _f(1, "samples generated for each prompt, decoded together as one batch", rule=positive())
    cache_length: int | None = _f(None, "positions the KV cache holds per sequence; None = longest prompt + "
                                        "max_new_tokens", rule=positive("or None"))
    quantize_kv_cache: bool = _f(False, "store cached keys and values as int8 with a float32 scale per position and kv head")
    quantize_weights: Literal["none", "int8"] = _f(
        "none", "`jaxlm generate`, `jaxlm serve` and jaxlm.load: int8 = the matmul weights (every layer's and the "
                "output projection) converted once at load to int8 with one float32 scale per output channel, "
                "multiplied as int8 (half a bf16 model's bytes read per token: docs/serve.md); none = as stored")
    stop_tokens: str = _f("", "comma-separated token ids that end a sample (it is kept in the output)")
    stop_at_eos: bool = _f(True, "also stop at the model's end-of-sequence token, when its tokenizer names one")
    draft: str = _f("", "`jaxlm generate` and `jaxlm serve`: a smaller model with the same tokenizer (run directory "
                        "or converted folder) that proposes tokens for the model to verify several at a time "
                        "(speculative decoding: the same distribution, greedy text identical); `mtp`: the model's "
                        "own first multi-token prediction module drafts (DeepSeek-V3's)")
    draft_tokens: int | None = _f(None, "tokens the draft proposes per forward pass of the model (decode.draft); "
                                        "None = 3 for a draft model, 1 for `mtp` (DeepSeek-V3's setting: the "
                                        "module reused on its own output rarely proposes right)", rule=positive())


@dataclass(frozen=True)
class ServeConfig:
    host: str = _f("127.0.0.1", "`jaxlm serve`: address to listen on; 0.0.0.0 opens the server to the network")
    port: int = _f(8000, "`jaxlm serve`: TCP port", rule=between("[1, 65535]"))
    uds: str = _f("", "`jaxlm serve`: listen on a unix domain socket at this path instead of serve.host:port (a "
                      "machine that refuses TCP sockets, a reverse proxy or sidecar in front); a socket file left by "
                      "a server that is gone is replaced; '' = TCP")
    max_slots: int = _f(64, "sequences in flight at most (decoded together; the decode step compiles for this "
                            "count, a half, a quarter and an eighth of it, and 4 and 1); with the slot cache "
                            "(serve.page_size=0) each holds the whole context", rule=at_least(1))
    page_size: int = _f(-1, "positions per page of the paged KV cache: a sequence holds the pages its tokens fill, "
                            "taken as it grows and given back when it ends; -1 = the devices' own (128 on a TPU, "
                            "whose page-attention kernel copies a page at a time; 16 elsewhere); 0 = the slot cache "
                            "(every slot the whole context)",
                        rule=at_least(-1, "-1 = the devices' own, 0 = the slot cache"))
    attention_kernel: Literal["jax", "ragged", "flat"] = _f(
        "ragged", "how a TPU reads the paged KV cache's pages for standard attention: `jax`, JAX's Pallas "
               "paged_attention for decode steps (prefill chunks read them in XLA); `ragged`, jaxlm's own Pallas "
               "kernel for decode steps and prefill chunks alike (model/ragged_paged.py); `flat`, XLA only. "
               "Windows, sinks and an int8 cache read in XLA with either kernel; other devices always do")
    attention_kernel_options: str = _f(
        "", "serve.attention_kernel=ragged: the kernel's settings as KEY=VALUE,... (docs/serve.md, \"The paged KV "
            "cache\"): block_tokens (keys a block reads, 512), row_bytes (queries a program takes, 1048576), "
            "heads_batched (a row's kv heads in one batched product, 1), page_steps (compute a page at a time, "
            "only the pages a row has, 1), prefetch (blocks read ahead, 2; heads_batched=0,page_steps=0,prefetch=1 "
            "is the kernel as first written), packed_kv (a kv head's key and value "
            "in one vector of 128 lanes: no padding for heads of 64; by default wherever the model allows: heads of "
            "at most 64, no int8 cache, no latent attention; 1 insists, 0 never), lanes_in_kernel=1 (queries "
            "padded to the pool's lanes and the output cut to the values' inside the kernel, not by XLA around "
            "it; 0), write_kernel (the steps' keys and values written into the pool by a Pallas kernel, not XLA's "
            "scatter, where the pool's pages are whole groups of 8 positions; 1, 0 the scatter); '' = the defaults")
    cache_gib: float = _f(0.0, "memory of the paged KV cache's pages, GiB; 0 = as much as gives every slot the "
                               "whole context, at most 4 GiB on a CPU and 80% of the free memory on an "
                               "accelerator", rule=at_least(0, "0 = automatic"))
    max_queue: int = _f(64, "sequences waiting for a slot at most; more are answered 429 with Retry-After, and a "
                            "request of more sequences than this (prompts x n) 400", rule=at_least(1))
    model_name: str = _f("", "model id of the OpenAI API (/v1/models, the `model` field); '' = the folder's name")
    adapters: str = _f("", "LoRA adapters served over the model, as NAME=PATH,... (PATH a PEFT adapter folder, a LoRA "
                           "run directory or a converted folder with an imported adapter): a request whose `model` "
                           "is NAME runs with that adapter, and requests for different adapters share decode "
                           "steps; /v1/models lists them")
    api_key: str = _f("", "answer 401 unless a request sends `Authorization: Bearer KEY`; '' = the JAXLM_API_KEY "
                          "environment variable, or no key when that is unset")
    api_key_file: str = _f("", "a file holding the API key (its first line), so that the key is not in the command "
                               "line that `ps` shows; used when serve.api_key is ''")
    allowed_hosts: str = _f("", "comma-separated Host header values answered (port left out; '*' = any); '' = "
                                "localhost, 127.0.0.1 and ::1 when serve.host is a loopback address (a web page "
                                "that rebinds its name to 127.0.0.1 is refused), any when it is not or when "
                                "serve.uds is set (a browser cannot reach a unix socket; a proxy in front decides)")
    allowed_origins: str = _f("", "comma-separated Origin values (e.g. https://app.example) whose cross-origin "
                                  "requests are answered; '' = none: a request that a browser sends from another "
                                  "site is refused (403)")
    max_body_mb: float = _f(8.0, "request bodies larger than this many MiB are refused (413) before they are read; "
                                 "the rest is read and thrown away (up to 256 MiB, for 30 s at most) so that "
                                 "clients that send the whole body first read the 413", rule=positive())
    max_header_kb: float = _f(32.0, "a request's line and headers larger than this many KiB are answered 431 and the "
                                    "connection closed, before more of them is read (nginx takes 32 KiB)",
                              rule=positive())
    max_headers: int = _f(100, "headers per request at most; more are answered 431", rule=at_least(1))
    header_timeout_s: float = _f(10.0, "a connection must send a request's line and headers within this many seconds "
                                       "of opening, or of its previous answer: 408 and closed (closed silently "
                                       "when nothing of a request came)", rule=positive())
    body_timeout_s: float = _f(60.0, "a request's body must arrive within this many seconds of its headers (408)",
                               rule=positive())
    max_connections: int = _f(1024, "open connections at most; past them new requests are answered 503",
                              rule=at_least(1))
    max_tokenize_chars: int = _f(1 << 20, "/tokenize texts longer than this many characters are answered 413",
                                 rule=at_least(1))
    chat_template: str = _f("", "a Jinja chat template file for /v1/chat/completions when the tokenizer has none")
    prefill_chunk: int = _f(512, "prompt tokens prefilled per engine turn at most: a longer prompt is prefilled a "
                                 "chunk per turn between the other slots' decode steps; prefill compiles once per "
                                 "chunk length (powers of two from 16 up to this)", rule=at_least(1))
    prefix_cache: int = _f(4, "share prompt prefixes: with the paged cache (any value > 0) a prompt's full pages stay "
                              "registered and a later prompt that starts with the same tokens takes them instead of "
                              "prefilling; with the slot cache, this many recent prompts' keys and values stay on "
                              "device (each one slot's memory) to be copied into a slot; 0 = off",
                           rule=at_least(0, "0 = off"))
    decode_steps: int = _f(8, "decode steps run in one device call at most, each row stopping at its stop token or "
                              "max_tokens inside the call; a turn that prefills runs one step (a new request's "
                              "first token), the others this many; 1 = one step per call", rule=at_least(1))
    allow_image_urls: bool = _f(False, "a chat request's image_url parts may be http(s) URLs, fetched by the server "
                                       "(within serve.max_body_mb, 10 s); false = only data:image/...;base64 URLs "
                                       "(an http(s) one is answered 400). Fetching lets clients make the server "
                                       "reach any address it can: leave false unless the network around it is safe")
    max_images_per_request: int = _f(8, "images in one chat request at most (a model with a vision tower); more are "
                                        "answered 400", rule=at_least(0, "0 = no images"))
    max_image_pixels: int = _f(33_554_432, "pixels (width x height) of one image at most, checked before it is "
                                           "decoded; larger ones are answered 400", rule=at_least(1))
    ui: bool = _f(True, "answer GET / with a chat page (static files in the package, talking to this server's "
                        "/v1/chat/completions; served without the API key, which its API calls need); false = none")
    replicas: int = _f(1, "engines over the same weights on one device, each with max_slots / replicas slots, its "
                          "own KV cache and thread; a request goes to the least busy. XLA:CPU runs one decode "
                          "program on about one core, so on a CPU host two replicas use two (docs/serve.md); keep "
                          "1 on an accelerator", rule=at_least(1))


@dataclass(frozen=True)
class CompileConfig:
    topology: str = _f("", "target of `jaxlm compile`: a TPU slice such as v4-8, v5e-16, v5e-256, v5p-128, v6e-256 "
                           "(or v5e:4x4 / v5p:4x4x12; needs the tpu extra), cpu-N (N CPU devices), or a3 (8 x H100 "
                           "per host; compile on a GPU host)")
    num_slices: int = _f(1, "TPU slices (or a3 hosts) the step is compiled for; mesh.dcn_* axes span them",
                         rule=at_least(1))
    output: str | None = _f(None, "`jaxlm compile`: save the compiled train step and its signature to this file")
    load: str | None = _f(None, "`jaxlm train`: run the train step saved by `jaxlm compile compile.output=FILE` "
                                "instead of compiling one; the run must match the settings it was compiled with")
    find_batch_size: bool = _f(False, "`jaxlm compile`: search the largest whole training.per_device_batch_size "
                                      "that fits the target by compiling candidates")
    max_batch_size: int = _f(1024, "largest per_device_batch_size the search tries", rule=at_least(1))
    hbm_gib: float | None = _f(None, "memory per device the step must fit in, GiB; None = the chip's HBM "
                                     "(aot.HBM_GIB), or host memory / devices for cpu-N",
                               rule=positive("or None: the chip's HBM"))
    cache_dir: str = _f("~/.cache/jaxlm/xla", "persistent XLA compilation cache: a rerun of the same step on the same "
                                                "devices loads it instead of compiling; '' = off. JAX's own "
                                                "JAX_COMPILATION_CACHE_DIR, when set, takes precedence")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    orpo: OrpoConfig = field(default_factory=OrpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    run_dir: str | None = _f(None, "run directory (a path, a file:// URL, or an fsspec URL such as gs://... for "
                                         "metrics only, docs/scaling.md); None = outputs/<timestamp>. A folder "
                                         "holding a checkpoint is resumed")
    seed: int = _f(1337, "seed for initialization, data order and dropout", rule=at_least(0))
    debug: bool = _f(False, "shortcut for profiler=xplane that also skips checkpoints")

    def replace(self, **kw) -> "Config":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def sections() -> dict[str, type]:
    """Config's sections by name: {'model': ModelConfig, ...}."""
    hints = typing.get_type_hints(Config)
    return {name: t for name, t in hints.items() if dataclasses.is_dataclass(t)}


def all_keys() -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, help) for every setting, in declaration order."""
    rows = []
    by_name = sections()
    defaults = Config()
    for f in dataclasses.fields(Config):
        if f.name in by_name:
            hints = typing.get_type_hints(by_name[f.name])
            for sf in dataclasses.fields(by_name[f.name]):
                rows.append((f"{f.name}.{sf.name}", hints[sf.name],
                             getattr(getattr(defaults, f.name), sf.name), sf.metadata.get("help", "")))
        else:
            rows.append((f.name, typing.get_type_hints(Config)[f.name], getattr(defaults, f.name),
                         f.metadata.get("help", "")))
    return rows


# Short spellings accepted on the command line and in files.
ALIASES = {"profiler": "profiler.mode", "orpo.lambda": "orpo.lambda_"}


def spelled(key: str) -> str:
    """A setting's key as users write it (`orpo.lambda` for the field orpo.lambda_)."""
    return next((alias for alias, k in ALIASES.items() if k == key and "." in alias), key)
