"""A toolkit model as a transformers model: native BERT classes where the math matches, the
remote code of shatter/hf/remote/ otherwise.

Native (no remote code): `bert` as `BertForMaskedLM`, `BertForQuestionAnswering`, and
`BertForSequenceClassification` when the head uses BERT's [CLS] strategy. BERT's token type
embeddings get one zero row (our models have none), the QA head a zero bias.

Remote code for every other arch and for bert's §3.4 (modified [CLS]) classifier: `bert-rpe`
included, because transformers' BERT has no relative-position variant any more (`relative_key`
was removed in transformers 5), and Shaw et al.'s as it had it differs from ours anyway: one
distance table shared by all heads, on the keys only, unclipped, where ours projects R through
each layer's W^K and W^V (relative keys and values, §2) and clips at +-(m - 1).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from shatter.config import ModelConfig
from shatter.hf.remote.configuration_shatter import ARCHS as REMOTE_ARCHS

# ModelConfig field -> the transformers config name (one source of truth for both directions)
CONFIG_NAMES = {
    "vocab_size": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "ffn": "intermediate_size",
    "max_len": "max_position_embeddings",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "initializer_range": "initializer_range",
    "layer_norm_eps": "layer_norm_eps",
    "pad_id": "pad_token_id",
    "sep_id": "sep_token_id",
    "rpe_max_distance": "rpe_max_distance",
    "rab_buckets": "rab_buckets",
    "rab_max_distance": "rab_max_distance",
}
REMOTE_FILES = ("configuration_shatter.py", "modeling_shatter.py")
# head kind -> (remote class, Auto class)
CLASSES = {
    None: ("ShatterForMaskedLM", "AutoModelForMaskedLM"),
    "sequence-classification": (
        "ShatterForSequenceClassification",
        "AutoModelForSequenceClassification",
    ),
    "span-extraction": ("ShatterForQuestionAnswering", "AutoModelForQuestionAnswering"),
}
NATIVE_CLASSES = {
    None: "BertForMaskedLM",
    "sequence-classification": "BertForSequenceClassification",
    "span-extraction": "BertForQuestionAnswering",
}

# our bert state-dict names -> transformers' BertFor* names
BERT_NAMES = [
    (r"encoder\.embeddings\.layer_norm\.", "bert.embeddings.LayerNorm."),
    (r"encoder\.embeddings\.", "bert.embeddings."),
    (r"encoder\.layers\.(\d+)\.attention\.", r"bert.encoder.layer.\1.attention.self."),
    (r"encoder\.layers\.(\d+)\.output\.", r"bert.encoder.layer.\1.attention.output.dense."),
    (
        r"encoder\.layers\.(\d+)\.attention_norm\.",
        r"bert.encoder.layer.\1.attention.output.LayerNorm.",
    ),
    (r"encoder\.layers\.(\d+)\.ffn_in\.", r"bert.encoder.layer.\1.intermediate.dense."),
    (r"encoder\.layers\.(\d+)\.ffn_out\.", r"bert.encoder.layer.\1.output.dense."),
    (r"encoder\.layers\.(\d+)\.ffn_norm\.", r"bert.encoder.layer.\1.output.LayerNorm."),
    (r"mlm_head\.dense\.", "cls.predictions.transform.dense."),
    (r"mlm_head\.layer_norm\.", "cls.predictions.transform.LayerNorm."),
    (r"mlm_head\.bias$", "cls.predictions.bias"),
    (r"mlm_head\.word_embeddings\.weight$", "cls.predictions.decoder.weight"),
    (r"pooler\.", "bert.pooler.dense."),
]


class ConvertError(ValueError):
    """A model that cannot be converted; the message says why and what to do."""


def head_kind(model: nn.Module) -> tuple[str | None, dict]:
    head = model.head_config() if hasattr(model, "head_config") else {}
    return head.get("head"), head


def is_native(config: ModelConfig, head: dict) -> bool:
    """Whether transformers' own BERT classes compute exactly our function."""
    if config.arch != "bert":
        return False
    return head.get("head") != "sequence-classification" or head.get("strategy") == "cls"


def check_convertible(config: ModelConfig) -> None:
    if config.arch not in REMOTE_ARCHS:
        raise ConvertError(
            f"arch {config.arch!r} has no transformers converter (shatter/hf/ knows "
            f"{', '.join(REMOTE_ARCHS)}); add it to shatter/hf/remote/modeling_shatter.py"
        )


def hf_config(model: nn.Module, labels: list[str] | None) -> Any:
    """The transformers config of `model` (native BertConfig or the remote ShatterConfig)."""
    config: ModelConfig = model.config
    kind, head = head_kind(model)
    fields = {CONFIG_NAMES[k]: v for k, v in config.to_dict().items() if k in CONFIG_NAMES}
    if kind == "sequence-classification":
        n = int(head["num_labels"])
        if labels is None or len(labels) != n:
            labels = [f"LABEL_{i}" for i in range(n)]
        fields["id2label"] = dict(enumerate(labels))
        fields["label2id"] = {label: i for i, label in enumerate(labels)}
        if n == 1:
            fields["problem_type"] = "regression"
    if is_native(config, head):
        from transformers import BertConfig

        native = {k: v for k, v in fields.items() if k not in ("sep_token_id",)}
        native = {k: v for k, v in native.items() if not k.startswith(("rpe_", "rab_"))}
        return BertConfig(hidden_act="gelu", type_vocab_size=1, **native)
    from shatter.hf.remote.configuration_shatter import ShatterConfig

    strategy = head.get("strategy", "modified")
    return ShatterConfig(arch=config.arch, classifier_strategy=strategy, **fields)


def hf_model(model: nn.Module, labels: list[str] | None = None) -> nn.Module:
    """A transformers model holding `model`'s weights (fp32, eval mode)."""
    check_convertible(model.config)
    kind, head = head_kind(model)
    config = hf_config(model, labels)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    if is_native(model.config, head):
        import transformers

        target = getattr(transformers, NATIVE_CLASSES[kind])(config)
        state = _bert_state(state, model.config.hidden)
        if kind == "span-extraction":
            state["qa_outputs.bias"] = torch.zeros(2)
    else:
        from shatter.hf.remote import modeling_shatter

        target = getattr(modeling_shatter, CLASSES[kind][0])(config)
        if "mlm_head.word_embeddings.weight" in state:
            state["mlm_head.decoder.weight"] = state.pop("mlm_head.word_embeddings.weight")
    missing, unexpected = target.load_state_dict(state, strict=False)
    tied = {"cls.predictions.decoder.bias"}  # BERT's decoder bias is the head's bias
    if unexpected or set(missing) - tied:
        raise ConvertError(
            f"{model.config.arch}: weights do not map onto {type(target).__name__}: "
            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if kind is None:  # the decoder is the word embeddings: stored once
        target.tie_weights()
    return target.eval()


def _bert_state(state: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for pattern, repl in BERT_NAMES:
            new, hits = re.subn(pattern, repl, key)
            if hits:
                key = new
                break
        out[key] = value
    out["bert.embeddings.token_type_embeddings.weight"] = torch.zeros(1, hidden)
    return out


def auto_map(kind: str | None) -> dict[str, str]:
    """config.json's `auto_map` for a remote-code export: the Auto classes that load it."""
    names = {
        "AutoConfig": "configuration_shatter.ShatterConfig",
        "AutoModel": "modeling_shatter.ShatterModel",
    }
    for cls, auto in CLASSES.values():
        names[auto] = f"modeling_shatter.{cls}"
    return names
