"""The embedded default model: a tiny Llama that vLLM can run with no downloads.

The folder holds only `config.json`, `tokenizer.json` and `tokenizer_config.json`; vLLM fills
the weights with random values (`load_format="dummy"`). The text it generates is noise, but
the engine around it is real: continuous batching, the paged KV cache, preemption and the
timings all behave as they do with a real model, which is what scheduling needs.

The tokenizer is a byte-level BPE trained here on a fixed English text, so that token counts
of English prompts are in the usual range (about 4 characters per token) and any string,
in any script, tokenizes without unknown tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.engine.vllm_local import LocalEngineConfig

TINY_MODEL_NAME = "justitia-tiny-llama"
VOCAB_SIZE = 1024
MAX_POSITION_EMBEDDINGS = 4096
FORMAT_VERSION = 1

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# Written for this project. The BPE merges learnt from it make English text tokenize at a
# realistic rate; nothing depends on its meaning.
_TRAINING_TEXT = """
Large language model agents split their work into many requests that run in parallel stages.
A summarization agent maps a long document into chunks, summarizes every chunk, and reduces the
partial summaries into one answer. A fact verification agent retrieves evidence for a claim and
asks the model to judge each piece. A voting agent samples several answers to the same question
and returns the most frequent one. A code checking agent writes tests for a function and runs
them. The user waits for the last request of the agent, so the time that matters is the time at
which the whole agent completes, not the latency of any single request.
The server keeps the key and value cache of every running request in memory. Memory is the
scarce resource: a request with a long prompt that generates many tokens holds a large share of
the cache for a long time. The scheduler decides which agent is served first. Serving agents
one after another in the order in which they would finish under a fair share of the memory
keeps the mean completion time low and never lets an agent wait forever.
The quick brown fox jumps over the lazy dog. Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000,
punctuation such as commas, periods; colons: quotes "like this" and (parentheses) appear too.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
The history of the city begins in the twelfth century, when merchants settled along the river.
Its population grew during the industrial revolution, and the railway reached it in 1850.
Question: what is the capital of France? Answer: Paris is the capital of France.
Claim: the river flows through three countries. Evidence: the river rises in the mountains.
"""


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the text lets rarer pairs reach the merge threshold, filling the vocabulary.
    tokenizer.train_from_iterator([_TRAINING_TEXT] * 8, trainer=trainer)
    return tokenizer


def _model_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> dict:
    # head_dim 32: the CPU attention backend rejects 16 (ENGINE_NOTES.md).
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "justitia_tiny_format": FORMAT_VERSION,
    }


def init_tiny(path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write the tiny model folder at `path` and return it.

    An existing folder made by this function is kept as it is unless `overwrite` is set;
    any other non-empty folder is refused rather than clobbered.
    """
    folder = Path(path).expanduser().resolve()
    if is_tiny_model(folder) and not overwrite:
        return folder
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{folder} is not empty and holds no tiny model; choose an empty folder"
        )
    folder.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    ids = {tok: tokenizer.token_to_id(tok) for tok in (BOS, EOS, PAD)}
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    config = _model_config(vocab_size, ids[BOS], ids[EOS], ids[PAD])
    # config.json last: its presence marks a complete folder.
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def is_tiny_model(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file() or not (folder / "tokenizer.json").is_file():
        return False
    try:
        return json.loads(config.read_text()).get("justitia_tiny_format") == FORMAT_VERSION
    except (OSError, ValueError):
        return False


def justitia_home() -> Path:
    """Justitia's own folder: models, history (JUSTITIA_HOME overrides ~/.cache/justitia)."""
    home = os.environ.get("JUSTITIA_HOME")
    base = Path(home) if home else Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "justitia"
    return base.expanduser()


def default_cache_dir() -> Path:
    """Where `justitia serve` keeps the embedded model."""
    return justitia_home() / "models" / TINY_MODEL_NAME


def ensure_default_model() -> Path:
    """The embedded model's folder, created on first use."""
    return init_tiny(default_cache_dir())


def embedded_engine_config(**settings: Any) -> LocalEngineConfig:
    """The in-process engine of the embedded model, as `justitia serve` runs it; `settings`
    are the rest of `LocalEngineConfig` (KV capacity, context length, ...).

    Everything that measures the embedded engine builds it here, so that it measures the
    engine the server runs: `bench calibrate` once left the dtype to vLLM, which runs a
    float32 model in bfloat16 on a CPU, and on a CPU without native bfloat16 (AVX2 only)
    it timed prefill at 124 us a token where the same calibration in float32 times 56-60 us
    (on an AVX2-only host; docs/benchmarks.md)."""
    from server.engine.vllm_local import LocalEngineConfig

    return LocalEngineConfig(
        model=str(ensure_default_model()),
        dummy_weights=True,  # the embedded model has no weights: random ones
        # bfloat16 on CPUs with AMX dies with SIGILL on batches of one or two tokens
        # (vLLM CPU 0.32, measured here), and without native bfloat16 it is slow; the
        # tiny model loses nothing in float32.
        dtype="float32",
        **settings,
    )
