"""Tokenizers behind one interface, the resolver that finds one from a name or path, and the rule that decides
which tokenizer a command uses (`resolve`; docs/data.md, "Tokenizers").

Kinds: `char` (the corpus's sorted characters), `byte` (UTF-8 bytes), `tiktoken` (an encoding name or a local
`.tiktoken` ranks file), `sentencepiece` (a `.model` file) and `huggingface` (a `tokenizer.json`, a folder holding
one, a `jaxlm convert from-hf` folder, or a hub id). Every one encodes plain text as text (special-token strings
never become special tokens), frames a document with BOS/EOS by its own conventions (`encode_document`), renders
chat templates as transformers does, and has a `spec` for meta.json whose `fingerprint` tells whether two
tokenizers encode alike.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import re
from pathlib import Path

from jaxlm.errors import UserError

TIKTOKEN_NAMES = ("gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base")
ROLES = ("system", "user", "assistant", "tool")


# From this many characters HFTokenizer.encode goes through the tokenizers package's encode_batch, which releases
# Python's GIL while the Rust code runs (its encode does not): a server tokenizing a long text in a worker thread
# then leaves its event loop free (docs/serve.md).
LONG_TEXT_CHARS = 16 << 10


class TokenizerError(UserError, ValueError):
    """Text that a tokenizer cannot encode, a tokenizer that cannot be found or loaded, or a mismatch."""


def _sha256(data: bytes | str) -> str:
    return "sha256:" + hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer(abc.ABC):
    """The common interface. Subclasses set vocab_size, bos_id, eos_id, spec and implement encode/decode."""

    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    chat_template: str | None = None
    spec: dict
    files: tuple[Path, ...] = ()  # the files it was loaded from, which a prepared dataset keeps a copy of
    _extra_stop: list[int] = []

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_document(self, text: str) -> list[int]:
        return self._frame(self.encode(text))

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [self._frame(ids) for ids in self.encode_batch(texts)]

    def _frame(self, ids: list[int]) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + ids + \
            ([self.eos_id] if self.eos_id is not None else [])

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: EOS, the end-of-turn ids the tokenizer's files name, and those added
        by add_stop_ids."""
        return tuple(dict.fromkeys(([self.eos_id] if self.eos_id is not None else []) + self._extra_stop))

    def add_stop_ids(self, ids) -> None:
        """More ids that end a generation (a converted model's eos_token_id list)."""
        self._extra_stop = list(dict.fromkeys([*self._extra_stop, *map(int, ids)]))

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """Special-token strings a chat template may write, and their ids."""
        return {}

    def token_strings(self) -> dict[str, str]:
        """Variables a chat template reads besides the messages: bos_token and eos_token ('' when none)."""
        return {"bos_token": self._piece(self.bos_id), "eos_token": self._piece(self.eos_id)}

    def _piece(self, i: int | None) -> str:
        return next((s for s, j in self.special_tokens.items() if j == i), "")

    def encode_rendered(self, text: str) -> list[int]:
        """Text a chat template rendered: its special-token strings become their ids, the rest is plain text."""
        specials = self.special_tokens
        if not specials:
            return self.encode(text)
        pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        ids: list[int] = []
        pos = 0
        for m in re.finditer(pattern, text):
            if m.start() > pos:
                ids += self.encode(text[pos:m.start()])
            ids.append(specials[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self.encode(text[pos:])
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError(f"the tokenizer {self.describe()} has no chat template; give one with "
                                 "--chat-template FILE (a Jinja template as in tokenizer_config.json)")
        return render_chat(self.chat_template, messages, add_generation_prompt, self.token_strings())

    def describe(self) -> str:
        return self.spec["kind"]

    @property
    def fingerprint(self) -> str:
        return self.spec["fingerprint"]


class CharTokenizer(Tokenizer):
    """One token per distinct character of the corpus, in sorted order (nanoGPT's shakespeare_char)."""

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}
        self.spec = {"kind": "char", "chars": chars, "fingerprint": _sha256(chars)}

    def encode(self, text: str) -> list[int]:
        missing = sorted({c for c in text if c not in self._index})
        if missing:
            raise TokenizerError(f"characters not in this char-level vocabulary: {''.join(missing)!r}")
        return [self._index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if 0 <= i < self.vocab_size else "\ufffd" for i in ids)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: a fixed 256-entry vocabulary that encodes any text."""

    vocab_size = 256
    spec = {"kind": "byte", "fingerprint": "byte"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer(Tokenizer):
    """tiktoken BPE: an encoding by name (downloaded once into tiktoken's cache), or a local `.tiktoken` ranks
    file. A file named after a known encoding (cl100k_base.tiktoken) takes that encoding's split pattern and
    special tokens; any other file takes GPT-2's split pattern and one special token, <|endoftext|>, after the
    ranks. The end-of-text token is the EOS; tiktoken encodings use no BOS."""

    def __init__(self, name_or_file: str):
        try:
            import tiktoken
            import tiktoken.load
            import tiktoken_ext.openai_public as openai_public
        except ImportError:
            raise TokenizerError("tiktoken tokenizers need the tiktoken package: pip install 'jaxlm[data]'") from None
        path = Path(name_or_file)
        try:
            if path.suffix == ".tiktoken":
                if not path.is_file():
                    raise TokenizerError(f"tiktoken ranks file {path} does not exist")
                ranks = tiktoken.load.load_tiktoken_bpe(str(path))
                name = path.stem
                if name in openai_public.ENCODING_CONSTRUCTORS:
                    # The constructor names the URL it would download; hand it the local ranks instead.
                    original = openai_public.load_tiktoken_bpe
                    openai_public.load_tiktoken_bpe = lambda *a, **k: ranks
                    try:
                        params = openai_public.ENCODING_CONSTRUCTORS[name]()
                    finally:
                        openai_public.load_tiktoken_bpe = original
                else:
                    params = {"name": name, "pat_str": openai_public.r50k_pat_str, "mergeable_ranks": ranks,
                              "special_tokens": {openai_public.ENDOFTEXT: len(ranks)}}
                self._enc = tiktoken.Encoding(**params)
                self.spec = {"kind": "tiktoken", "file": str(path.resolve()), "encoding": name,
                             "fingerprint": _sha256(path.read_bytes())}
                self.files = (path,)
            else:
                self._enc = tiktoken.get_encoding(name_or_file)
                self.spec = {"kind": "tiktoken", "encoding": name_or_file,
                             "fingerprint": f"tiktoken:{name_or_file}"}
        except TokenizerError:
            raise
        except Exception as e:  # noqa: BLE001 - network, cache and file errors vary
            raise TokenizerError(f"cannot load the tiktoken encoding {name_or_file!r} (offline and not cached? give "
                                 f"a local .tiktoken file): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                 ) from None
        self.vocab_size = self._enc.n_vocab
        self.eos_id = self._enc.eot_token if openai_public.ENDOFTEXT in self._enc.special_tokens_set else None

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        return {s: self._enc.encode_single_token(s) for s in self._enc.special_tokens_set}

    def describe(self) -> str:
        return f"tiktoken:{self.spec['encoding']}"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`: its BOS starts each document when the model defines one, its EOS ends it."""

    def __init__(self, file: str | Path, config: dict | None = None):
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerError("SentencePiece tokenizers need the sentencepiece package: "
                                 "pip install 'jaxlm[data]'") from None
        path = Path(file)
        if not path.is_file():
            raise TokenizerError(f"SentencePiece model {path} does not exist")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError variously
            raise TokenizerError(f"{path} is not a SentencePiece model: {str(e).splitlines()[0]}") from None
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.chat_template = chat_template_of(config or {})
        self.spec = {"kind": "sentencepiece", "file": str(path.resolve()), "fingerprint": _sha256(path.read_bytes())}
        self.files = (path, *_config_files(path.parent))

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)
                if self._sp.is_control(i) and i != self._sp.unk_id()}

    def describe(self) -> str:
        return f"sentencepiece:{self.spec['file']}"


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json, with the special tokens and chat template of the
    tokenizer_config.json (and chat_template.jinja) beside it. BOS comes from the tokenizer's post-processor
    (Llama 3 and Gemma add one, GPT-2 and Qwen do not); EOS is the config's eos_token."""

    def __init__(self, file: str | Path, config: dict | None = None, stop_ids: list[int] | None = None,
                 source: str | None = None):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise TokenizerError("Hugging Face tokenizers need the tokenizers package: pip install 'jaxlm[data]'"
                                 ) from None
        path = Path(file)
        text = path.read_text()
        try:
            self._hf = RustTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - the Rust side raises its own exception type
            raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json: {str(e).splitlines()[0]}") from None
        self._hf.encode_special_tokens = True  # plain text never yields special tokens
        config = config or {}
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._id(_token_text(config.get("eos_token")))
        # The post-processor's BOS, if it adds one: the first id it puts before a text's own ids.
        plain, framed = self._hf.encode("a", add_special_tokens=False).ids, self._hf.encode("a").ids
        self.bos_id = framed[0] if len(framed) > len(plain) and framed[:1] != plain[:1] else None
        self.chat_template = chat_template_of(config)
        self._config = config
        self._extra_stop = [i for i in (stop_ids or []) if i != self.eos_id]
        parsed = json.loads(text)
        canonical = json.dumps({"model": parsed.get("model"), "added_tokens": parsed.get("added_tokens"),
                                "normalizer": parsed.get("normalizer"), "pre_tokenizer": parsed.get("pre_tokenizer")},
                               sort_keys=True)
        self.spec = {"kind": "huggingface", "path": source or str(path.resolve()), "fingerprint": _sha256(canonical)}
        self.files = (path, *_config_files(path.parent))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._hf.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        if len(text) >= LONG_TEXT_CHARS:  # the same ids; encode_batch lets go of the GIL while it works
            return self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self._hf.encode(text, add_special_tokens=False).ids

    def _batch(self, texts: list[str], special: bool) -> list:
        # encode_batch_fast (tokenizers >= 0.20) gives the same ids without computing character offsets
        fast = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return fast(texts, add_special_tokens=special)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._batch(texts, False)]

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [self._frame(e.ids) for e in self._batch(texts, True)]

    def _frame(self, ids: list[int]) -> list[int]:
        # `ids` come with the post-processor's special tokens, which end some tokenizers' texts with their EOS
        return ids + [self.eos_id] if self.eos_id is not None and (not ids or ids[-1] != self.eos_id) else ids

    def encode_document(self, text: str) -> list[int]:
        return self._frame(self._hf.encode(text, add_special_tokens=True).ids)

    def encode_rendered(self, text: str) -> list[int]:
        self._hf.encode_special_tokens = False
        try:
            return self._hf.encode(text, add_special_tokens=False).ids
        finally:
            self._hf.encode_special_tokens = True

    def decode(self, ids) -> str:
        return self._hf.decode([int(i) for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=False)

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}

    def token_strings(self) -> dict[str, str]:
        out = {k: _token_text(self._config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return {k: v or "" for k, v in out.items()}

    def describe(self) -> str:
        return f"huggingface:{self.spec['path']}"


def chat_template_of(config: dict) -> str | None:
    """The default chat template of a tokenizer_config.json (a string, or a list of named templates)."""
    t = config.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if x.get("name") == "default"), None)
    return t if isinstance(t, str) and t else None


CONFIG_FILES = ("special_tokens_map.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                "generation_config.json")


def _config_files(folder: Path) -> list[Path]:
    return [folder / n for n in CONFIG_FILES if (folder / n).is_file()]


def save_copy(tok: Tokenizer, directory: str | Path) -> dict:
    """Copy the files `tok` was loaded from into directory/tokenizer/ (a prepared dataset keeps the tokenizer it
    was made with, wherever the original goes) and return its spec naming the copy."""
    import shutil

    folder = Path(directory) / "tokenizer"
    shutil.rmtree(folder, ignore_errors=True)
    if not tok.files:
        return dict(tok.spec)
    folder.mkdir(parents=True)
    for f in tok.files:
        shutil.copyfile(f, folder / f.name)
    return dict(tok.spec) | {"copy": f"tokenizer/{tok.files[0].name}"}


def _read_config(folder: Path) -> dict:
    """tokenizer_config.json, special_tokens_map.json and a chat_template.jinja/.json beside them, merged."""
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            config.update(json.loads((folder / name).read_text()))
    if (folder / "chat_template.jinja").is_file():
        config["chat_template"] = (folder / "chat_template.jinja").read_text()
    elif (folder / "chat_template.json").is_file():
        config["chat_template"] = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return config


def _stop_ids(folder: Path) -> list[int]:
    """End-of-turn ids from generation_config.json, or the hf_config.json a converted model keeps beside
    its tokenizer/ folder."""
    for f in (folder / "generation_config.json", folder.parent / "hf_config.json", folder / "config.json"):
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return list(eos) if isinstance(eos, list) else [eos]
    return []


def _from_folder(folder: Path, source: str | None = None) -> Tokenizer:
    if (folder / "tokenizer").is_dir() and not (folder / "tokenizer.json").is_file():
        folder = folder / "tokenizer"  # a `jaxlm convert from-hf` folder
    config = _read_config(folder)
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder / "tokenizer.json", config, _stop_ids(folder), source=source)
    if (folder / "tokenizer.model").is_file():
        return SentencePieceTokenizer(folder / "tokenizer.model", config)
    raise TokenizerError(f"{folder} holds no tokenizer.json, tokenizer.model or tokenizer/ folder")


def _from_hub(repo_id: str) -> Tokenizer:
    """The tokenizer files of a hub repository, downloaded once into the Hugging Face cache."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise TokenizerError(f"--tokenizer {repo_id} is a hub id; that needs huggingface_hub "
                             "(pip install 'jaxlm[hf]')") from None
    files = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "chat_template.json", "generation_config.json", "tokenizer.model"]
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=files))
    except Exception as e:  # noqa: BLE001 - network, auth and missing-repo errors vary
        raise TokenizerError(f"cannot fetch the tokenizer of {repo_id} from the Hugging Face hub (offline? give a "
                             f"local folder): {str(e).splitlines()[0]}") from None
    return _from_folder(folder, source=repo_id)


def load(spec: str | Path | dict) -> Tokenizer:
    """A tokenizer from a name or path (`byte`, a tiktoken encoding name, x.tiktoken, x.model, tokenizer.json,
    a folder, a converted model's folder, a hub id) or from a meta.json `tokenizer` entry."""
    if isinstance(spec, dict):
        return from_spec(spec)
    s = str(spec)
    path = Path(s).expanduser()
    if s == "byte":
        return ByteTokenizer()
    if s == "char":
        raise TokenizerError("a char tokenizer's vocabulary comes from its corpus: use `jaxlm prepare text "
                             "--vocab char`, or name a prepared folder whose meta.json holds it")
    if path.suffix == ".tiktoken" or (s in TIKTOKEN_NAMES and not path.exists()):
        return TiktokenTokenizer(s)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, _read_config(path.parent) if path.is_file() else None)
    if path.suffix == ".json" and path.is_file() and path.name != "meta.json":
        return HFTokenizer(path, _read_config(path.parent), _stop_ids(path.parent))
    if path.is_dir():
        if (path / "meta.json").is_file() and not any((path / n).exists() for n in
                                                      ("tokenizer.json", "tokenizer.model")):
            return from_meta(json.loads((path / "meta.json").read_text()), path)  # a prepared dataset
        return _from_folder(path)
    if path.name == "meta.json" and path.is_file():
        return from_meta(json.loads(path.read_text()), path.parent)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", s) and not path.exists():
        return _from_hub(s)
    raise TokenizerError(f"unknown tokenizer {s!r}: give byte, a tiktoken encoding ({', '.join(TIKTOKEN_NAMES)}), "
                         "a .tiktoken file, a SentencePiece .model, a tokenizer.json, a folder holding one (a "
                         "`jaxlm convert from-hf` folder works), a prepared dataset folder, or a hub id org/name")


def from_spec(spec: dict, directory: str | Path | None = None) -> Tokenizer:
    """Rebuild a tokenizer from the description `spec` gives (a meta.json `tokenizer` entry); with the prepared
    folder `directory`, from the copy of its files kept there."""
    kind = spec.get("kind")
    copy = Path(directory) / spec["copy"] if directory is not None and spec.get("copy") else None
    if copy is not None and not copy.is_file():
        copy = None
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tiktoken":
        return TiktokenTokenizer(str(copy or spec.get("file") or spec["encoding"]))
    if kind in ("sentencepiece", "huggingface"):
        source = str(copy or spec.get("file") or spec.get("path"))
        tok = load(source)
        if spec.get("fingerprint") and tok.fingerprint != spec["fingerprint"]:
            raise TokenizerError(f"the tokenizer at {source} has changed since the data was prepared with it "
                                 "(its vocabulary differs); prepare the data again")
        if spec.get("chat_template") and not tok.chat_template:
            tok.chat_template = spec["chat_template"]
        return tok
    raise TokenizerError(f"meta.json names an unknown tokenizer kind {kind!r} "
                         "(known: char, byte, tiktoken, sentencepiece, huggingface)")


def from_meta(meta: dict, directory: str | Path | None = None) -> Tokenizer:
    """The tokenizer a prepared folder's meta.json records (from its kept copy when `directory` is given)."""
    return from_spec(meta.get("tokenizer", {}), directory)


def check_same(dataset_spec: dict | None, tok: Tokenizer, dataset: str = "the dataset", model: str = "the model"
               ) -> None:
    """Refuse, in one line, a dataset prepared with another tokenizer than `tok` (the model's or the one named
    by --tokenizer/data.tokenizer). Datasets without a recorded tokenizer pass."""
    if not dataset_spec or "kind" not in dataset_spec:
        return
    theirs = dataset_spec.get("fingerprint") or (from_spec(dataset_spec).fingerprint)
    if theirs != tok.fingerprint:
        raise TokenizerError(f"{dataset} was prepared with the tokenizer {_describe_spec(dataset_spec)} but {model} "
                             f"uses {tok.describe()}; prepare the data again with --tokenizer set to the model's")


def _describe_spec(spec: dict) -> str:
    kind = spec.get("kind")
    detail = spec.get("file") or spec.get("path") or spec.get("encoding")
    return f"{kind}:{detail}" if detail else str(kind)


def resolve(explicit: str | None = None, model_dir: str | Path | None = None, meta: dict | None = None,
            dataset: str = "the dataset") -> Tokenizer:
    """The tokenizer a command uses, highest first: the one named explicitly (--tokenizer, data.tokenizer), a
    converted model's tokenizer/ folder (`model_dir`), the dataset's meta.json; the dataset's must agree with a
    higher one (check_same)."""
    if explicit:
        tok, who = load(explicit), f"--tokenizer/data.tokenizer {explicit}"
    elif model_dir is not None:
        tok, who = _from_folder(Path(model_dir)), f"the model's tokenizer ({model_dir})"
    elif meta is not None and meta.get("tokenizer"):
        return from_meta(meta)
    else:
        raise TokenizerError("no tokenizer: give --tokenizer (or data.tokenizer), a converted model folder, or a "
                             "prepared dataset whose meta.json records one")
    if meta is not None:
        check_same(meta.get("tokenizer"), tok, dataset, who)
    return tok


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool, variables: dict) -> str:
    """Render a chat template in a sandbox, with the helpers transformers gives templates (raise_exception,
    strftime_now, a tojson that keeps non-ASCII text)."""
    import datetime

    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerError("chat templates need the jinja2 package: pip install jinja2") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _JINJA.get(template)
    if env is None:
        e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[jinja2.ext.loopcontrols, _generation_tag()])
        e.filters["tojson"] = tojson
        e.globals["raise_exception"] = raise_exception
        e.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            env = _JINJA[template] = e.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise TokenizerError(f"the chat template does not parse (line {err.lineno}): {err.message}") from None
    try:
        return env.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as err:
        raise TokenizerError(f"the chat template refused these messages: {err}") from None


_JINJA: dict = {}


def _generation_tag():
    """`{% generation %}...{% endgeneration %}`, which some templates wrap assistant text in for transformers'
    assistant masks: rendered as its body (chat.py finds assistant tokens by prefixes instead)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return Generation
