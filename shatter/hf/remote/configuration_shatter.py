"""The Hugging Face config of a Shatter-toolkit encoder (any arch the toolkit exports as remote
code: shatter, its ablations, bert-rpe, bert-rab, xlnet, and bert with the modified [CLS] head).

This file is copied into every such export and loaded by `trust_remote_code=True`; it imports
only transformers. `arch` picks the attention variant; the other fields are the toolkit's
model config under the names transformers uses.
"""

from transformers import PretrainedConfig

ARCHS = (
    "bert",
    "bert-rpe",
    "bert-rab",
    "no-position",
    "part-mask",
    "1h-softmax",
    "1h-sigmoid",
    "part-bias",
    "shatter",
    "xlnet",
)
STRATEGIES = ("modified", "cls")


class ShatterConfig(PretrainedConfig):
    model_type = "shatter"

    def __init__(
        self,
        arch: str = "shatter",
        vocab_size: int = 32000,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,  # for the partition archs: the number of parts n
        intermediate_size: int = 3072,
        max_position_embeddings: int = 512,
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-12,
        pad_token_id: int = 0,
        sep_token_id: int = 3,  # xlnet's segments are counted from it
        rpe_max_distance: int = 128,  # bert-rpe: distances clipped to +-(rpe_max_distance - 1)
        rab_buckets: int = 32,  # bert-rab: T5 relative attention bias buckets
        rab_max_distance: int = 128,
        classifier_strategy: str = "modified",  # sequence classification: §3.4 query, or [CLS]
        **kwargs,
    ):
        if arch not in ARCHS:
            raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
        if classifier_strategy not in STRATEGIES:
            raise ValueError(f"unknown classifier_strategy {classifier_strategy!r}")
        self.arch = arch
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.pad_token_id = pad_token_id
        self.sep_token_id = sep_token_id
        self.rpe_max_distance = rpe_max_distance
        self.rab_buckets = rab_buckets
        self.rab_max_distance = rab_max_distance
        self.classifier_strategy = classifier_strategy
        kwargs.setdefault("tie_word_embeddings", True)  # the MLM decoder is the word embeddings
        super().__init__(pad_token_id=pad_token_id, **kwargs)
