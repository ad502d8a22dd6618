"""Training with images on Llama 4's and Qwen-VL's towers (docs/vision.md, "Training with images"): chat data
prepared in the kind's layout (Llama 4: each image's tiles on its own canvas, or one tile; Qwen-VL: each image at its
own grid within a budget, or one square) whose stored tokens and pixels are what data/image_kinds.py gives the same
images; the padded towers equal to the static ones per canvas or grid; the train step's loss on a batch equal to
the masked cross-entropy of forward() on the same tokens and images (and not equal without them); what cannot work
refused in one line; and a tiny random Qwen2.5-VL that learns to name the drawn shape from images of mixed aspect
ratios."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxlm import params as P
from jaxlm.config.model_schema import VisionConfig
from jaxlm.data import image_kinds, images_llama4, images_qwen, loader as loader_lib, tokenizer as tokenizer_lib
from jaxlm.data import train_images, vision_data
from jaxlm.data.errors import DataError
from jaxlm.model import forward
from jaxlm.train import batches, objectives, run as run_lib

from test_vision_train import COLOURS, QUESTION, SHAPES, data_url, draw, record, write_jsonl

PIL = pytest.importorskip("PIL")
pytest.importorskip("tokenizers")

TURNS = ["<pad>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ["<unk>", "user", "model", "What", "is", "in", "the", "image", "?", "a", *COLOURS, *SHAPES]
SPECIALS = {"qwen2_5": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
            "qwen3": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
            "llama4": ["<|image_start|>", "<|patch|>", "<|image_end|>", "<|image|>", "<|tile_x_separator|>",
                       "<|tile_y_separator|>"]}
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
            "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
SIDE = 32
BUDGET = 16  # Qwen-VL soft tokens an image at most (1,024 pixels at 4-pixel patches merged 2 x 2)
ASPECTS = [(32, 32), (48, 24), (24, 48), (40, 32), (56, 24), (20, 36)]  # (width, height) of pictures, cycled
MAX_TILES = 4  # Llama 4 canvases of up to 4 tiles of SIDE (then the global tile): 5 tile slots an image
TILE_ASPECTS = [(32, 32), (48, 24), (24, 48), (64, 60), (40, 32), (20, 36)]  # canvases 1x1, 1x2, 2x1, 2x2, 1x2, 2x1


def vocab(kind: str) -> list[str]:
    return TURNS + SPECIALS[kind] + WORDS


def vision(kind: str) -> VisionConfig:
    ids = {t: i for i, t in enumerate(vocab(kind))}
    s = SPECIALS[kind]
    common = dict(image_token_id=ids[s[1]], boi_token_id=ids[s[0]], eoi_token_id=ids[s[2]], d_model=32, n_layers=2,
                  n_heads=2)
    if kind == "llama4":  # 8 x 8 patches of 4 pixels, pixel-shuffled 2 x 2 to 16 soft tokens a tile
        return VisionConfig(kind="llama4", image_size=SIDE, patch_size=4, d_ff=128, tokens_per_image=16,
                            activation="gelu", projector_dim=48, norm_eps=1e-5, **common)
    if kind == "qwen3":  # learned positions on a 8 x 8 grid, one deepstack layer, interleaved M-RoPE
        return VisionConfig(kind="qwen3", patch_size=4, d_ff=48, activation="gelu_tanh", spatial_merge=2,
                            temporal_patch=2, mrope_section="2,3,3", mrope_interleaved=True, position_embeddings=64,
                            deepstack_layers="0", **common)
    return VisionConfig(kind="qwen2_5", patch_size=4, d_ff=48, activation="silu", spatial_merge=2, temporal_patch=2,
                        window_size=16, full_attention_layers="1", mrope_section="2,3,3", **common)


def model_folder(folder, kind: str):
    """A folder standing for a converted model: config.json's model.vision, tokenizer.json with the kind's image
    tokens as special tokens, a chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = vocab(kind)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TURNS + SPECIALS[kind]])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({"model": {"vision": vision(kind).__dict__}}))
    (folder / "preprocessor_config.json").write_text("{}")  # the released models' image settings at the tower's sizes
    return folder


def processor(kind: str):
    """The tower's processor as the model folder's preprocessor_config.json would give it (Qwen: pixel bounds that
    keep a 32 x 32 square)."""
    if kind == "llama4":
        return images_llama4.TileProcessor(size=SIDE)
    return images_qwen.Processor(patch_size=4, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64,
                                 **({"mean": (0.5,) * 3, "std": (0.5,) * 3} if kind == "qwen3" else {}))


def config(tmp_path, kind: str, **overrides):
    v = vision(kind)
    d = {"model.vision": v.__dict__, "model.vocab_size": len(vocab(kind)), "model.d_model": 64,
         "model.block_size": 48, "data.tokenizer": str(tmp_path / "model"), **overrides}
    if kind != "llama4":  # M-RoPE over head_dim 16: sections 2 + 3 + 3
        d.update({"model.n_heads": 4, "model.rope_theta": 10000.0})
    return tiny_config(tmp_path / "data", tmp_path / "run", **d)


def pictures(n: int, seed: int, side: int = SIDE, aspects: list | None = None):
    """n drawn shapes with their answers: squares of `side`, or resized to the (width, height) of `aspects` in
    turn."""
    rng = np.random.default_rng(seed)
    classes = [(c, s) for c in COLOURS for s in SHAPES]
    out = []
    for i in range(n):
        c, s = classes[i % len(classes)]
        img = draw(c, s, rng)
        size = aspects[i % len(aspects)] if aspects else (side, side)
        out.append((img if img.size == size else img.resize(size), f"a {c} {s}"))
    return out


def budgeted(kind: str):
    """What `jaxlm generate --image` takes for images trained within BUDGET soft tokens (Llama 4: on canvases of
    MAX_TILES tiles): the processor with max_pixels at the budget (max_patches at MAX_TILES)."""
    if kind == "llama4":
        return dataclasses.replace(processor(kind), max_tiles=MAX_TILES)
    return dataclasses.replace(processor(kind), max_pixels=BUDGET * 64)


def reference(kind: str, grids: bool):
    """The processor image_kinds takes for data prepared with `grids` (Llama 4 without: one tile an image)."""
    if grids:
        return budgeted(kind)
    return dataclasses.replace(processor(kind), max_tiles=1) if kind == "llama4" else processor(kind)


def prepared(tmp_path, kind: str, n: int = 12, two: bool = False, grids: bool = False):
    """A prepared folder of n conversations (each with one drawn shape; with two=True the even ones with a second
    image), its pictures, and the model folder. grids: images of mixed aspect ratios, Qwen-VL's each at its own grid
    within BUDGET soft tokens (else one square of SIDE), Llama 4's on canvases of up to MAX_TILES tiles (else one)."""
    folder = model_folder(tmp_path / "model", kind)
    pics = pictures(n, 0, aspects=(TILE_ASPECTS if kind == "llama4" else ASPECTS) if grids else None)
    recs = []
    for i, (img, answer) in enumerate(pics):
        rec = record({"type": "image_url", "image_url": {"url": data_url(img)}}, answer)
        if two and i % 2 == 0:
            rec["messages"][0]["content"].insert(1, {"type": "image_url",
                                                     "image_url": {"url": data_url(pics[i - 1][0])}})
        recs.append(rec)
    src = write_jsonl(tmp_path / "chat.jsonl", recs)
    side = SIDE if kind != "llama4" and not grids else None
    tokens = BUDGET if grids and kind != "llama4" else None
    meta = vision_data.prepare_vision_chat([src], tmp_path / "data", folder, val_fraction=0.25,
                                           processor=processor(kind), image_side=side, image_tokens=tokens,
                                           max_tiles=(MAX_TILES if grids else 1) if kind == "llama4" else None)
    return meta, pics, folder


def padded(prep: list, v, P: int) -> dict:
    """image_kinds' patch grids as the padded batch of the training step: patches in the processor's order."""
    patches = np.zeros((len(prep), P, prep[0].pixels.shape[-1]), np.float32)
    for i, x in enumerate(prep):
        flat = images_qwen.hf_order(x.pixels, v.spatial_merge)
        patches[i, :len(flat)] = flat
    return {"patches": patches, "grid": np.array([x.pixels.shape[1:3] for x in prep], np.int32)}


def tiled(prep: list, K: int) -> dict:
    """image_kinds' tiles as the padded batch of the training step: each image's in K slots, and its canvas."""
    tiles = np.zeros((len(prep), K) + prep[0].pixels.shape[1:], np.float32)
    for i, x in enumerate(prep):
        tiles[i, :len(x.pixels)] = x.pixels
    return {"tiles": tiles, "canvas": np.array([x.layout for x in prep], np.int32).reshape(-1, 2)}


def kind_prepared(kind, img, p, v):
    """One image as data/image_kinds.py prepares it (serving, `jaxlm generate --image`)."""
    return image_kinds.of(v).prepare(img, p, v)


def check_stored(got: dict, want: dict, key: str) -> None:
    grid = "canvas" if key == "tiles" else "grid"
    assert np.array_equal(got[grid], want[grid]) and np.abs(got[key] - want[key]).max() <= 1e-6


@pytest.mark.parametrize("kind,grids", [("llama4", False), ("llama4", True), ("qwen2_5", False), ("qwen2_5", True),
                                        ("qwen3", True)])
def test_prepared_tokens_and_pixels_are_image_kinds(tmp_path, kind, grids):
    meta, pics, folder = prepared(tmp_path, kind, two=True, grids=grids)
    v, p, info = vision(kind), reference(kind, grids), meta["images"]
    assert info["kind"] == kind and info["max_per_document"] == 2
    if kind == "llama4":
        assert (info["layout"], info["max_tiles"], info["tiles"]) == (("tiles", 4, 5) if grids else ("tiles", 1, 1))
    else:
        assert info.get("layout") == "grids" if grids else info["size"] == SIDE
    ds = loader_lib.Dataset(tmp_path / "data")
    tok = tokenizer_lib.load(folder)
    store = vision_data.open_images(ds)
    kind_of = image_kinds.of(v)
    # The first document of train: conversation 0 (two images: 0 and the last one).
    split = ds.splits["train"]
    ids = split.document(0).tolist()
    used = [pics[0][0], pics[-1][0]]
    prep = [kind_prepared(kind, img, p, v) for img in used]
    marker = vision_data.check_image_tokens(tok, v)
    text = tok.apply_chat_template([{"role": "user", "content": marker * 2 + QUESTION},
                                    {"role": "assistant", "content": pics[0][1]}],
                                   add_generation_prompt=False)
    assert ids == tok.encode_rendered(kind_of.expand(text, tok, v, prep))
    assert ids.count(v.image_token_id) == sum(x.tokens for x in prep) == {
        ("llama4", True): 16 + 3 * 16, ("llama4", False): 2 * 16}.get((kind, grids), 16 + 8 if grids else 2 * 16)
    got = store["train"].read(np.array(list(store["train"].of(0))))
    if kind == "llama4":  # tiles [2, K, 32, 32, 3] and canvases: 1 x 1 and 2 x 1 (and the global tile)
        K = store["train"].fixed.shape["tiles"][0]
        check_stored(got, tiled(prep, K), "tiles")
        assert got["canvas"].tolist() == ([[1, 1], [2, 1]] if grids else [[1, 1], [1, 1]])
        if grids:  # every train image: six aspect ratios, canvases 1x1, 1x2, 2x1, 2x2
            by_image = stored_pictures(store["train"], pics, lambda img: kind_prepared(kind, img, p, v))
            slots = np.array(sorted(by_image))
            check_stored(store["train"].read(slots), tiled([by_image[i] for i in slots], K), "tiles")
            assert {tuple(c) for c in store["train"].read(slots, "canvas")} == {(1, 1), (1, 2), (2, 1), (2, 2)}
        else:  # a folder prepared before tiles (meta.json without a layout, no canvases) reads the same
            check_one_tile_folder(tmp_path / "data", got)
    else:  # Qwen: padded patches [2, 64, Q] and grids; with grids the 32 x 32 and the 20 x 36 pictures (8 x 8, 8 x 4)
        want = padded(prep, v, store["train"].fixed.shape["patches"][0])
        assert np.array_equal(got["grid"], want["grid"]) and np.abs(got["patches"] - want["patches"]).max() <= 1e-6
        assert got["grid"].tolist() == ([[8, 8], [8, 4]] if grids else [[8, 8], [8, 8]])
        if grids:  # every train image: six aspect ratios, eight grids
            by_image = stored_pictures(store["train"], pics, lambda img: kind_prepared(kind, img, p, v))
            slots = np.array(sorted(by_image))
            got, want = store["train"].read(slots), padded([by_image[i] for i in slots], v, got["patches"].shape[1])
            assert np.array_equal(got["grid"], want["grid"]) and np.abs(got["patches"] - want["patches"]).max() <= 1e-6
            assert len({tuple(g) for g in got["grid"]}) >= 6
    mask = split.take(np.arange(len(ids)), mask=True)
    assert [t for t, m in zip(ids, mask) if m] == tok.encode_rendered(pics[0][1] + "<end_of_turn>")


@pytest.mark.parametrize("kind", ["qwen2_5", "qwen3"])
def test_the_padded_tower_is_the_static_one_per_grid(tmp_path, kind):
    """Four grids of other aspect ratios (windowed and full layers; deepstack) padded to 64 patch slots, the padding
    and an empty slot filled with garbage: the soft tokens (and deepstack features) compacted in order, and the
    logits of two rows holding them, equal the static tower's at each grid."""
    from jaxlm import sharding
    from jaxlm.model import param_specs, vision_qwen, vision_qwen3

    cfg = config(tmp_path, kind, **{"model.block_size": 128}).model
    weights = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(tiny_config(tmp_path, tmp_path).mesh,
                                                                             jax.devices()[:1]))
    weights = jax.tree.map(lambda a: a * 3 if a.ndim > 1 else a + 0.1, weights)  # beyond init's near-identity
    rng, shapes = np.random.default_rng(0), [(8, 6), (4, 16), (6, 10), (2, 2)]
    grids = [rng.normal(size=(1, h, w, 96)).astype(np.float32) for h, w in shapes]
    images = padded([image_kinds.Prepared(g, 0) for g in grids] + [image_kinds.Prepared(np.zeros((1, 0, 0, 96)), 0)],
                    cfg.vision, 64)
    images["patches"][images["patches"] == 0] = 7.0
    tower = vision_qwen if kind == "qwen2_5" else vision_qwen3
    static, padded_out = jax.jit(lambda w, g, x: (tower.encode(w, g, cfg), tower.encode_padded(w, x, cfg)))(
        weights["vision"], tuple(grids), images)
    if kind == "qwen3":
        (static, deep_static), (soft, deep, valid) = static, padded_out
    else:
        soft, valid = padded_out
    X = static.shape[0]
    got, _, _, order = vision_qwen.compacted(soft, valid, jnp.asarray(images["grid"]), cfg)
    assert int(valid.sum()) == X == 44 and np.abs(got[:X] - static).max() <= 1e-5 * np.abs(static).max()
    if kind == "qwen3":
        S, I, M, D = deep.shape
        deep_got = deep.reshape(S, I * M, D)[:, order][:, :X]
        assert np.abs(deep_got - deep_static).max() <= 1e-5 * np.abs(deep_static).max()
    pad, n = cfg.vision.image_token_id, [h * w // 4 for h, w in shapes]
    rows = [[15, 16] + [pad] * n[0] + [17, 18] + [pad] * n[1] + [19], [20] + [pad] * (n[2]) + [21] + [pad] * n[3]]
    tokens = jnp.asarray([r + [0] * (48 - len(r)) for r in rows])
    run = jax.jit(lambda x: forward(weights, tokens, cfg, images=x))
    want, blind, logits = run(tuple(grids)), run(None), run(jax.tree.map(jnp.asarray, images))
    print(f"{kind}: soft tokens up to {float(np.abs(static).max()):.2f}, padded - static "
          f"{float(np.abs(got[:X] - static).max()):.1e}; logits {float(np.abs(logits - want).max()):.1e} (without "
          f"images {float(np.abs(blind - want).max()):.2f})")
    assert np.abs(logits - want).max() <= 2e-5 and np.abs(blind - want).max() > 0.1


def check_one_tile_folder(folder, got: dict) -> None:
    """The folder rewritten as one tile an image was prepared before tiles (meta.json's images without a layout, no
    canvases beside) reads as `got`: the same tiles, each on a 1 x 1 canvas."""
    meta = json.loads((folder / "meta.json").read_text())
    meta["images"] = {k: v for k, v in meta["images"].items()
                      if k not in ("layout", "max_tiles", "tiles", "resize_to_max_canvas")}
    (folder / "meta.json").write_text(json.dumps(meta))
    for split in ("train", "val"):
        (folder / f"{split}-images.grid.npy").unlink()
    store = vision_data.open_images(loader_lib.Dataset(folder))["train"]
    assert not store.fixed.stores_grids and store.fixed.shape["tiles"] == (1, SIDE, SIDE, 3)
    again = store.read(np.array(list(store.of(0))))
    assert np.array_equal(again["canvas"], got["canvas"]) and np.array_equal(again["tiles"], got["tiles"])


def test_the_padded_llama4_tower_is_the_static_one_per_canvas(tmp_path):
    """Images on canvases of 1 x 1, 1 x 2, 2 x 1 and 2 x 2 tiles (with their global tiles) padded to 5 tile slots,
    the padding and an empty slot filled with garbage: the soft tokens compacted in order, and the logits of two rows
    holding them, equal the static tower's on the images' tiles."""
    from jaxlm import sharding
    from jaxlm.model import param_specs, vision_llama4

    cfg = config(tmp_path, "llama4", **{"model.block_size": 128}).model
    weights = P.init(param_specs(cfg), jax.random.key(0), sharding.make_mesh(tiny_config(tmp_path, tmp_path).mesh,
                                                                             jax.devices()[:1]))
    weights = jax.tree.map(lambda a: a * 3 if a.ndim > 1 else a + 0.1, weights)  # beyond init's near-identity
    rng, canvases = np.random.default_rng(0), [(1, 1), (1, 2), (2, 1), (2, 2)]
    prep = [image_kinds.Prepared(rng.normal(size=(train_images.tile_count(c), SIDE, SIDE, 3)).astype(np.float32), 0, c)
            for c in canvases]
    images = tiled(prep + [image_kinds.Prepared(np.zeros((0, SIDE, SIDE, 3)), 0, (0, 0))], 5)
    images["tiles"][images["tiles"] == 0] = 7.0
    static_tiles = np.concatenate([x.pixels for x in prep])
    static, (soft, valid) = jax.jit(lambda w, t, x: (vision_llama4.encode(w, t, cfg),
                                                     vision_llama4.encode_padded(w, x, cfg)))(
        weights["vision"], static_tiles, images)
    got, X = vision_llama4.compacted(soft, valid), static.shape[0] * static.shape[1]
    static = static.reshape(X, -1)
    assert int(valid.sum()) == len(static_tiles) == 12 and np.abs(got[:X] - static).max() <= 1e-5 * np.abs(static).max()
    pad, n = cfg.vision.image_token_id, [16 * len(x.pixels) for x in prep]
    rows = [[15, 16] + [pad] * n[0] + [17] + [pad] * n[1] + [18] + [pad] * n[2] + [19], [20] + [pad] * n[3] + [21]]
    tokens = jnp.asarray([r + [0] * (128 - len(r)) for r in rows])
    run = jax.jit(lambda x: forward(weights, tokens, cfg, images=x))
    want, blind, logits = run(jnp.asarray(static_tiles)), run(None), run(jax.tree.map(jnp.asarray, images))
    print(f"llama4: soft tokens up to {float(np.abs(static).max()):.2f}, padded - static "
          f"{float(np.abs(got[:X] - static).max()):.1e}; logits {float(np.abs(logits - want).max()):.1e} (without "
          f"images {float(np.abs(blind - want).max()):.2f})")
    assert np.abs(logits - want).max() <= 2e-5 and np.abs(blind - want).max() > 0.1


def test_what_cannot_work_is_one_line(tmp_path, capsys):
    folder = model_folder(tmp_path / "model", "qwen2_5")
    src = write_jsonl(tmp_path / "c.jsonl", [record({"type": "image_url", "image_url": {"url": data_url(
        pictures(1, 0)[0][0])}}, "a red circle")] * 4)
    with pytest.raises(DataError, match=r"image side 36: Qwen-VL training squares must be a multiple of patch x "
                                        r"merge = 8 pixels"):
        vision_data.prepare_vision_chat([src], tmp_path / "d1", folder, image_side=36, processor=processor("qwen2_5"))
    with pytest.raises(DataError, match=r"image side 32: .*within the processor's \[3136, 1003520\] pixels"):
        vision_data.prepare_vision_chat([src], tmp_path / "d2", folder, image_side=32)  # the released bounds
    folder4 = model_folder(tmp_path / "m4", "llama4")
    with pytest.raises(DataError, match=r"image side 64: a llama4 tower takes 32-pixel images"):
        vision_data.prepare_vision_chat([src], tmp_path / "d3", folder4, image_side=64)
    f = train_images.of_model(None, vision("qwen2_5"), 64, processor("qwen2_5"))
    assert f.shape == {"patches": (256, 96), "grid": (2,)} and f.meta()["patch_size"] == 4
    with pytest.raises(DataError, match=r"image tokens 3: 3 soft tokens of 8x8 pixels are under the processor's "
                                        r"min_pixels 256; give at least 4"):
        vision_data.prepare_vision_chat([src], tmp_path / "d4", folder, image_tokens=3, processor=processor("qwen2_5"))
    with pytest.raises(DataError, match=r"image side and image tokens both given"):
        vision_data.prepare_vision_chat([src], tmp_path / "d5", folder, image_tokens=16, image_side=32)
    with pytest.raises(DataError, match=r"image tokens 16: a llama4 tower takes a fixed number"):
        vision_data.prepare_vision_chat([src], tmp_path / "d6", folder4, image_tokens=16)
    with pytest.raises(DataError, match=r"max tiles 4: a qwen2_5 tower does not cut images into tiles"):
        vision_data.prepare_vision_chat([src], tmp_path / "d7", folder, max_tiles=4)
    with pytest.raises(DataError, match=r"max tiles 0: an image takes at least one tile"):
        vision_data.prepare_vision_chat([src], tmp_path / "d8", folder4, max_tiles=0)
    assert train_images.of_model(folder4, vision("llama4")).shape["tiles"] == (17, SIDE, SIDE, 3)  # max_patches 16
    with pytest.raises(DataError, match=r"no image processor settings: this model has no tokenizer/ folder"):
        train_images.of_model(None, vision("llama4"))
    from jaxlm import cli

    def prepare(model, out, *flags):
        return cli.main(["prepare", "chat", str(src), "--images", "--tokenizer", str(model), "--max-tokens", "200",
                         "--val-fraction", "0.25", "--out", str(tmp_path / out), "--no-progress", *flags])

    assert prepare(folder4, "d9", "--max-tiles", "2") == 0
    assert json.loads((tmp_path / "d9" / "meta.json").read_text())["images"]["tiles"] == 3
    capsys.readouterr()
    assert prepare(folder, "d10", "--max-tiles", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max tiles 2: a qwen2_5 tower does not cut images into tiles" in err[0]


def stored_pictures(store, pics, prepare) -> dict:
    """Each stored image of the train split (every 4th conversation is val; the even ones hold the picture before
    theirs second) -> prepare(its picture)."""
    out = {}
    for d, c in enumerate(i for i in range(len(pics)) if i % 4 != 3):
        for slot, img in zip(store.of(d), [pics[c][0]] + ([pics[c - 1][0]] if c % 2 == 0 else [])):
            out[slot] = prepare(img)
    return out


def segments(batch, b):
    """(start, end) of each document of row b: its segments (packed), else the whole row."""
    if "segment_ids" not in batch:
        return [(0, batch["inputs"].shape[1])]
    seg = np.asarray(batch["segment_ids"][b])
    return [(int(np.argmax(seg == s)), int(len(seg) - np.argmax(seg[::-1] == s))) for s in np.unique(seg[seg > 0])]


def batch_loss(tmp_path, kind, packing, grids=False):
    """The train objective's loss on a loader's batch; the same from forward() on each of its documents alone with
    the images image_kinds gives that document's pictures; and forward()'s without any images."""
    _, pics, _ = prepared(tmp_path, kind, n=12, two=True, grids=grids)
    block = 224 if kind == "llama4" and grids else 72 if grids else 96  # Llama 4: up to 2 images of 5 tiles
    cfg = config(tmp_path, kind, **{"data.packing": packing, "training.batch_size": 4, "model.block_size": block,
                                    "data.images_per_row": 4})
    run = run_lib.setup(cfg, jax.devices()[:1])
    params = P.init(run.specs, jax.random.key(0), run.mesh)
    plan = batches.make_loader(run, grad_accum=1).next().only_micro_batch()
    batch = batches.device_batch(run, "train", plan)
    loss = float(objectives.get("next_token").loss(params, batch, cfg, None)[0])
    v, p, store = cfg.model.vision, reference(kind, grids), run.images["train"]
    by_image = stored_pictures(store, pics, lambda img: kind_prepared(kind, img, p, v))
    prep = [by_image[int(s)] for s in np.asarray(plan.slots) if s >= 0]
    tokens, targets, w = (np.asarray(batch[k]) for k in ("inputs", "targets", "weights"))
    total, blind_total, at = 0.0, 0.0, 0
    for b in range(tokens.shape[0]):
        for start, end in segments(batch, b):
            ids = jnp.asarray(tokens[b:b + 1, start:end])
            n, count = 0, int((tokens[b, start:end] == v.image_token_id).sum())
            while count > 0:  # this document's images: as many as its image tokens hold
                count, n = count - prep[at + n].tokens, n + 1
            mine, at = prep[at:at + n], at + n
            for images, acc in ((image_kinds.of(v).batch(mine) if mine else None, "seen"), (None, "blind")):
                logp = np.asarray(jax.nn.log_softmax(forward(params, ids, cfg.model, images=images), -1))[0]
                nll = -np.take_along_axis(logp, targets[b, start:end, None], -1)[:, 0]
                value = float((nll * w[b, start:end]).sum())
                total, blind_total = (total + value, blind_total) if acc == "seen" else (total, blind_total + value)
    assert at == len(prep)
    docs = sum(len(segments(batch, b)) for b in range(tokens.shape[0]))
    return loss, total / w.sum(), blind_total / w.sum(), len(prep), docs


@pytest.mark.parametrize("kind,packing,grids", [
    ("llama4", False, False), ("llama4", True, True), ("qwen2_5", False, False), ("qwen2_5", True, True),
    ("qwen3", True, True)])
def test_the_step_loss_is_forward_with_the_images(tmp_path, kind, packing, grids):
    loss, want, blind, n, docs = batch_loss(tmp_path, kind, packing, grids)
    print(f"{kind} packing={packing} grids={grids}: {docs} documents, {n} images in 4 rows, step loss {loss:.6f}, "
          f"forward {want:.6f}, without images {blind:.6f}")
    assert n >= 4 and abs(loss - want) <= 1e-5 and abs(loss - blind) > 1e-3
    assert docs > 4 if packing else docs == 4  # packed rows hold several conversations, their M-RoPE positions right


def qwen_accuracy(model, tok, v, pics, blank=False) -> float:
    """Held-out greedy accuracy of the whole answer, each picture (or a blank one) as image_kinds prepares it."""
    marker = vision_data.check_image_tokens(tok, v)
    text = tok.apply_chat_template([{"role": "user", "content": marker + QUESTION}], add_generation_prompt=True)
    end = tok.encode_rendered("<end_of_turn>")
    rng, right = np.random.default_rng(0), 0
    for img, answer in pics:
        prep = [kind_prepared("qwen2_5", draw("red", "circle", rng, blank=True).resize(img.size) if blank else img,
                              budgeted("qwen2_5"), v)]
        prompt = tok.encode_rendered(image_kinds.of(v).expand(text, tok, v, prep))
        out = model.generate(prompt, new_tokens=4, temperature=0.0, stop_ids=tuple(end),
                             images=image_kinds.of(v).batch(prep))
        right += tok.decode([t for t in out if t not in end]).split() == answer.split()
    return right / len(pics)


@pytest.mark.slow
@pytest.mark.in_ci
def test_a_tiny_qwen_vl_learns_to_name_the_drawn_shape(tmp_path):
    import time

    import jaxlm
    from jaxlm.train import loop

    folder = model_folder(tmp_path / "model", "qwen2_5")
    train, val = pictures(1440, 0, aspects=ASPECTS), pictures(90, 1, aspects=ASPECTS)  # six aspect ratios, eight grids
    files = [write_jsonl(tmp_path / f"{name}.jsonl", [record({"type": "image_url", "image_url": {"url": data_url(i)}},
                                                              a) for i, a in pics])
             for name, pics in (("train", train), ("val", val))]
    vision_data.prepare_vision_chat(files[:1], tmp_path / "data", folder, val=files[1:], processor=processor("qwen2_5"),
                                    image_tokens=BUDGET)
    cfg = config(tmp_path, "qwen2_5", **{"model.block_size": 40, "training.steps": 250, "training.batch_size": 16,
                                         "training.eval_interval": 250, "optimizer.lr": 3e-3,
                                         "optimizer.warmup_steps": 10, "checkpoint.interval": 250})
    start = time.perf_counter()
    loop.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
    seconds = time.perf_counter() - start
    model, tok, v = jaxlm.load(tmp_path / "run"), tokenizer_lib.load(folder), cfg.model.vision
    seen, blind = qwen_accuracy(model, tok, v, val), qwen_accuracy(model, tok, v, val, blank=True)
    print(f"Qwen2.5-VL: held-out greedy accuracy {seen:.3f} with the image, {blind:.3f} with a blank one; {seconds:.1f} s")
    assert seen >= 0.9 and blind <= 2 / 9

    # The tower was frozen (training.freeze_vision, the default): bit-identical to its initialization. LoRA of
    # the language model on the same data keeps it so, and its loss stays low.
    run = run_lib.setup(cfg, jax.devices()[:1], data=False)
    fresh = jax.device_get(P.init(run.specs, jax.random.key(cfg.seed), run.mesh)["vision"])
    same = lambda tree: all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh),  # noqa: E731
                                                                   jax.tree.leaves(jax.device_get(tree))))
    assert same(model.params["vision"])
    lora_cfg = cfg.replace(run_dir=str(tmp_path / "lora"), lora=dataclasses.replace(cfg.lora, rank=4),
                           checkpoint=dataclasses.replace(cfg.checkpoint, init_from=str(tmp_path / "run")),
                           training=dataclasses.replace(cfg.training, steps=10, eval_interval=10))
    out = loop.train(lora_cfg, devices=jax.devices()[:1], log=lambda s: None)
    assert out["val_loss"] < 0.1 and same(jaxlm.load(tmp_path / "lora").params["vision"])
