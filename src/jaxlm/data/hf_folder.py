"""What a Hugging Face model folder says besides its weights and tokenizer, read in the order transformers 5 resolves
it, for `jaxlm convert` (both ways), `jaxlm generate`, `jaxlm serve`, the Python API and the image code
(docs/vision.md, "Model folders"): the special ids the model is built with (text_config, then the top of
config.json: model_ids), the ids generation stops at (generation_config.json, then config.json's top, then its
text_config: eos_ids), and the image processor's settings (processor_config.json's image_processor, else
preprocessor_config.json; a folder with neither is refused in one line, never defaulted: image_settings). A folder
is a Hugging Face one (config.json beside the other files) or a converted one's tokenizer/ (the source's
config.json kept beside it as hf_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxlm.data.errors import DataError

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def read_json(path: Path) -> dict | None:
    """A JSON object file, or None where there is none (a malformed one is a one-line DataError)."""
    if not path.is_file():
        return None
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise DataError(f"{path} holds a JSON {type(out).__name__}, not an object")
    return out


def model_config(folder: Path) -> dict | None:
    """The model's config.json of a folder: a converted folder's hf_config.json beside its tokenizer/, or the
    folder's own config.json (a Hugging Face folder)."""
    folder = Path(folder)
    return read_json(folder.parent / "hf_config.json") or read_json(folder / "config.json")


def model_ids(config: dict) -> dict[str, object]:
    """The special ids a config gives the model: each from text_config where it has the key, else from the top."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return {k: text[k] if k in text else config[k] for k in SPECIAL_IDS if k in text or k in config}


def _as_ids(value) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else () if value is None else (value,)


def eos_ids(config: dict | None, generation: dict | None) -> tuple[int, ...]:
    """The ids generation stops at: generation_config.json's eos_token_id, else config.json's at the top, else its
    text_config's (an id or a list; () where none names one)."""
    for source in (generation or {}, config or {}, (config or {}).get("text_config") or {}):
        if source.get("eos_token_id") is not None:
            return _as_ids(source["eos_token_id"])
    return ()


def stop_ids(folder: Path) -> tuple[int, ...]:
    """eos_ids of a folder's config.json and generation_config.json."""
    return eos_ids(model_config(folder), read_json(Path(folder) / "generation_config.json"))


def image_settings(folder: Path | None) -> tuple[dict, str]:
    """(the image processor's settings, the file they came from): processor_config.json's image_processor, else
    preprocessor_config.json. Neither is a one-line DataError naming the files looked for."""
    if folder is not None:
        nested = read_json(Path(folder) / PROCESSOR_FILES[0])
        if nested is not None and isinstance(nested.get("image_processor"), dict):
            return nested["image_processor"], PROCESSOR_FILES[0]
        flat = read_json(Path(folder) / PROCESSOR_FILES[1])
        if flat is not None:
            return flat, PROCESSOR_FILES[1]
    where = "this model has no tokenizer/ folder" if folder is None else f"{folder} has none"
    raise DataError(f"no image processor settings: {where} (looked for processor_config.json with an "
                    "image_processor entry, then preprocessor_config.json); copy the model's processor files there, "
                    "or write {} into preprocessor_config.json there to take the released models' settings at the "
                    "tower's sizes")
