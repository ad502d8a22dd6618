"""Peak host memory of `jaxlm convert from-hf` on a random Llama-shaped model of about --gb GB (float32).

The source safetensors file is written tensor by tensor (no torch, never the whole model in memory), then
the import runs in a fresh process whose peak RSS (ru_maxrss, which includes the interpreter and JAX) is
compared with the model's size. Prints one JSON line: model_bytes, peak_rss_bytes, ratio, seconds.
"""

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxlm.store import convert


def write_model(folder: Path, gb: float) -> int:
    D, F, V, N, K = 1024, 2816, 32000, 16, 4
    per_layer = 2 * D * D + 2 * D * D * K // N + 3 * D * F + 2 * D
    L = max(1, round((gb * 1e9 / 4 - 2 * V * D - D) / per_layer))
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": D, "intermediate_size": F,
          "num_hidden_layers": L, "num_attention_heads": N, "num_key_value_heads": K, "vocab_size": V,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
          "tie_word_embeddings": False}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    H = D // N
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (D, D), p + "self_attn.k_proj.weight": (K * H, D),
                       p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, D),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    rng = np.random.default_rng(0)
    f32 = np.dtype(np.float32)
    convert.write_safetensors(folder / "model.safetensors", [(n, s, f32) for n, s in shapes.items()],
                              lambda n: rng.standard_normal(shapes[n], np.float32) * 0.02)
    return sum(int(np.prod(s)) * 4 for s in shapes.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/jaxlm_convert_memory")
    a = ap.parse_args()
    folder = Path(a.dir)
    shutil.rmtree(folder / "jaxlm", ignore_errors=True)  # from_hf refuses to overwrite an earlier import
    size = write_model(folder / "hf", a.gb)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from jaxlm.store import convert; "
                    "convert.from_hf(sys.argv[1], sys.argv[2], log=lambda s: None)",
                    str(folder / "hf"), str(folder / "jaxlm")], check=True, env={"JAX_PLATFORMS": "cpu",
                                                                                   **__import__("os").environ})
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"model_bytes": size, "peak_rss_bytes": peak, "ratio": round(peak / size, 3),
                      "seconds": round(time.perf_counter() - t, 1)}))


if __name__ == "__main__":
    main()
