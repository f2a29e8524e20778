"""The encoder-decoder Transformer, its learning-rate schedule and greedy decoding.

Blocks normalise before each sub-layer ("pre-LN"), which trains stably at small sizes and
with few warm-up steps; padding (token id 0) is masked out of every attention, and the
decoder's self-attention is causal. Custom layers are registered Keras serializables, so
model.keras loads back with ``keras.saving.load_model`` once this module is imported.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

PACKAGE = "kubetrain"


def positional_encoding(length: int, depth: int) -> np.ndarray:
    """The sinusoidal position table of "Attention Is All You Need", shape (length, depth)."""
    positions = np.arange(length)[:, None]
    rates = 1.0 / np.power(10000.0, (2 * (np.arange(depth)[None, :] // 2)) / depth)
    angles = positions * rates
    table = np.zeros((length, depth), dtype=np.float32)
    table[:, 0::2] = np.sin(angles[:, 0::2])
    table[:, 1::2] = np.cos(angles[:, 1::2])
    return table


@keras.saving.register_keras_serializable(package=PACKAGE)
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embeddings scaled by sqrt(hidden size) plus fixed sinusoidal positions."""

    def __init__(self, vocab_size: int, max_length: int, hidden_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.max_length, self.hidden_size = vocab_size, max_length, hidden_size
        # Sub-layers share this layer's dtype policy, also when a mixed-precision model is
        # loaded back into a float32 process.
        self.embedding = keras.layers.Embedding(
            vocab_size, hidden_size, name="tokens", dtype=self.dtype_policy
        )
        self._positions = positional_encoding(max_length, hidden_size)

    def build(self, tokens_shape: Any) -> None:
        self.embedding.build(tokens_shape)

    def call(self, tokens: Any) -> Any:
        x = self.embedding(tokens)
        x = x * ops.cast(math.sqrt(self.hidden_size), x.dtype)
        length = ops.shape(tokens)[1]
        return x + ops.cast(ops.convert_to_tensor(self._positions)[:length], x.dtype)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "max_length": self.max_length,
            "hidden_size": self.hidden_size,
        }


def _pair_mask(query_tokens: Any, key_tokens: Any) -> Any:
    """(batch, queries, keys) mask: True where both positions hold real tokens."""
    q = ops.not_equal(query_tokens, 0)
    k = ops.not_equal(key_tokens, 0)
    return ops.logical_and(ops.expand_dims(q, 2), ops.expand_dims(k, 1))


class _Block(keras.layers.Layer):
    def __init__(self, hidden_size: int, num_heads: int, ff_size: int, dropout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden_size, self.num_heads, self.ff_size, self.dropout = (
            hidden_size,
            num_heads,
            ff_size,
            dropout,
        )
        self.ff_in = keras.layers.Dense(ff_size, activation="relu", name="ff_in", dtype=self.dtype_policy)
        self.ff_out = keras.layers.Dense(hidden_size, name="ff_out", dtype=self.dtype_policy)
        self.ff_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="ff_norm", dtype=self.dtype_policy)
        self.ff_drop = keras.layers.Dropout(dropout, dtype=self.dtype_policy)

    def _attention(self, name: str) -> keras.layers.MultiHeadAttention:
        return keras.layers.MultiHeadAttention(
            self.num_heads,
            self.hidden_size // self.num_heads,
            dropout=self.dropout,
            name=name,
            dtype=self.dtype_policy,
        )

    def _build_feed_forward(self, x_shape: Any) -> None:
        self.ff_norm.build(x_shape)
        self.ff_in.build(x_shape)
        self.ff_out.build((*x_shape[:-1], self.ff_size))

    def _feed_forward(self, x: Any, training: Any) -> Any:
        return x + self.ff_drop(self.ff_out(self.ff_in(self.ff_norm(x))), training=training)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "ff_size": self.ff_size,
            "dropout": self.dropout,
        }


@keras.saving.register_keras_serializable(package=PACKAGE)
class EncoderBlock(_Block):
    """Self-attention over the question, then a feed-forward layer."""

    def __init__(self, hidden_size: int, num_heads: int, ff_size: int, dropout: float, **kwargs: Any) -> None:
        super().__init__(hidden_size, num_heads, ff_size, dropout, **kwargs)
        self.attention = self._attention("self_attention")
        self.norm = keras.layers.LayerNormalization(
            epsilon=1e-6, name="attention_norm", dtype=self.dtype_policy
        )
        self.drop = keras.layers.Dropout(dropout, dtype=self.dtype_policy)

    def build(self, x_shape: Any, tokens_shape: Any) -> None:
        self.norm.build(x_shape)
        self.attention.build(x_shape, x_shape)
        self._build_feed_forward(x_shape)

    def call(self, x: Any, tokens: Any, training: Any = None) -> Any:
        h = self.norm(x)
        h = self.attention(h, h, attention_mask=_pair_mask(tokens, tokens), training=training)
        x = x + self.drop(h, training=training)
        return self._feed_forward(x, training)


@keras.saving.register_keras_serializable(package=PACKAGE)
class DecoderBlock(_Block):
    """Causal self-attention over the reply so far, attention to the encoder, feed-forward."""

    def __init__(self, hidden_size: int, num_heads: int, ff_size: int, dropout: float, **kwargs: Any) -> None:
        super().__init__(hidden_size, num_heads, ff_size, dropout, **kwargs)
        self.self_attention = self._attention("self_attention")
        self.cross_attention = self._attention("cross_attention")
        policy = self.dtype_policy
        self.self_norm = keras.layers.LayerNormalization(
            epsilon=1e-6, name="self_attention_norm", dtype=policy
        )
        self.cross_norm = keras.layers.LayerNormalization(
            epsilon=1e-6, name="cross_attention_norm", dtype=policy
        )
        self.self_drop = keras.layers.Dropout(dropout, dtype=self.dtype_policy)
        self.cross_drop = keras.layers.Dropout(dropout, dtype=self.dtype_policy)

    def build(self, y_shape: Any, encoded_shape: Any, tokens_shape: Any, encoder_tokens_shape: Any) -> None:
        self.self_norm.build(y_shape)
        self.self_attention.build(y_shape, y_shape)
        self.cross_norm.build(y_shape)
        self.cross_attention.build(y_shape, encoded_shape)
        self._build_feed_forward(y_shape)

    def call(self, y: Any, encoded: Any, tokens: Any, encoder_tokens: Any, training: Any = None) -> Any:
        h = self.self_norm(y)
        h = self.self_attention(
            h, h, attention_mask=_pair_mask(tokens, tokens), use_causal_mask=True, training=training
        )
        y = y + self.self_drop(h, training=training)
        h = self.cross_norm(y)
        h = self.cross_attention(
            h, encoded, attention_mask=_pair_mask(tokens, encoder_tokens), training=training
        )
        y = y + self.cross_drop(h, training=training)
        return self._feed_forward(y, training)


def build_transformer(
    *,
    vocab_size: int,
    max_input_length: int,
    max_output_length: int,
    num_layers: int,
    num_heads: int,
    hidden_size: int,
    ff_size: int,
    dropout: float,
) -> keras.Model:
    """Encoder tokens and decoder tokens (reply shifted right, starting with ``<s>``) in,
    next-token logits (float32) out."""
    encoder_tokens = keras.Input((max_input_length,), dtype="int32", name="encoder_tokens")
    decoder_tokens = keras.Input((max_output_length,), dtype="int32", name="decoder_tokens")
    x = TokenAndPositionEmbedding(vocab_size, max_input_length, hidden_size, name="encoder_embedding")(
        encoder_tokens
    )
    x = keras.layers.Dropout(dropout)(x)
    for i in range(num_layers):
        x = EncoderBlock(hidden_size, num_heads, ff_size, dropout, name=f"encoder_{i}")(x, encoder_tokens)
    encoded = keras.layers.LayerNormalization(epsilon=1e-6, name="encoder_norm")(x)
    y = TokenAndPositionEmbedding(vocab_size, max_output_length, hidden_size, name="decoder_embedding")(
        decoder_tokens
    )
    y = keras.layers.Dropout(dropout)(y)
    for i in range(num_layers):
        y = DecoderBlock(hidden_size, num_heads, ff_size, dropout, name=f"decoder_{i}")(
            y, encoded, decoder_tokens, encoder_tokens
        )
    y = keras.layers.LayerNormalization(epsilon=1e-6, name="decoder_norm")(y)
    logits = keras.layers.Dense(vocab_size, dtype="float32", name="logits")(y)
    return keras.Model(
        {"encoder_tokens": encoder_tokens, "decoder_tokens": decoder_tokens},
        logits,
        name="dialogue_transformer",
    )


@keras.saving.register_keras_serializable(package=PACKAGE)
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """scale * hidden^-0.5 * min(step^-0.5, step * warmup^-1.5): linear warm-up, then 1/sqrt decay."""

    def __init__(self, hidden_size: int, warmup_steps: int, scale: float = 1.0) -> None:
        self.hidden_size, self.warmup_steps, self.scale = hidden_size, warmup_steps, scale

    def __call__(self, step: Any) -> Any:
        step = ops.cast(step, "float32") + 1.0  # the optimizer counts from 0
        return (self.scale * self.hidden_size**-0.5) * ops.minimum(
            ops.power(step, -0.5), step * self.warmup_steps**-1.5
        )

    def get_config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "warmup_steps": self.warmup_steps, "scale": self.scale}


def seq2seq_sums(model: keras.Model, batch: Any, training: bool) -> dict[str, tf.Tensor]:
    """Per-replica sums: per-example mean token loss, and token accuracy over real tokens."""
    inputs, targets = batch
    logits = model(inputs, training=training)
    mask = tf.cast(tf.not_equal(targets, 0), tf.float32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=tf.cast(logits, tf.float32)
    )
    tokens = tf.reduce_sum(mask, axis=1)
    per_example = tf.reduce_sum(losses * mask, axis=1) / tf.maximum(tokens, 1.0)
    predicted = tf.argmax(logits, axis=-1, output_type=targets.dtype)
    correct = tf.reduce_sum(tf.cast(tf.equal(predicted, targets), tf.float32) * mask)
    return {
        "loss_sum": tf.reduce_sum(per_example),
        "examples": tf.cast(tf.shape(targets)[0], tf.float32),
        "correct": correct,
        "count": tf.reduce_sum(tokens),
    }


def greedy_token_ids(
    model: keras.Model,
    encoder_tokens: tf.Tensor,
    max_output_length: int,
    bos_id: int,
    eos_id: int,
    banned: tuple[int, ...] = (0,),
) -> tf.Tensor:
    """Reply token ids by greedy decoding, in the graph: shape (batch, max_output_length).

    Each step takes the most likely next token among those not ``banned`` (``<pad>``, and
    ``<s>`` which only starts the decoder input); the rows that have produced ``</s>``
    get ``<pad>`` from then on, and the loop ends once every row has. Written with
    ``tf.while_loop`` rather than autograph, so that it also traces inside a SavedModel
    endpoint.
    """
    encoder_tokens = tf.convert_to_tensor(encoder_tokens, tf.int32)
    n = tf.shape(encoder_tokens)[0]
    positions = tf.range(max_output_length)[None, :]
    vocab_size = model.output.shape[-1]
    penalty = tf.reduce_sum(tf.one_hot(list(banned), vocab_size, on_value=-1e9, off_value=0.0), axis=0)
    decoder = tf.where(tf.equal(positions, 0), bos_id, tf.zeros([n, max_output_length], tf.int32))
    replies = tf.zeros([n, max_output_length], tf.int32)
    done = tf.zeros([n], tf.bool)

    def more(t: tf.Tensor, decoder: tf.Tensor, replies: tf.Tensor, done: tf.Tensor) -> tf.Tensor:
        return tf.logical_and(t < max_output_length, tf.logical_not(tf.reduce_all(done)))

    def step(t: tf.Tensor, decoder: tf.Tensor, replies: tf.Tensor, done: tf.Tensor):
        logits = model({"encoder_tokens": encoder_tokens, "decoder_tokens": decoder}, training=False)
        scores = tf.cast(tf.gather(logits, t, axis=1), tf.float32) + penalty
        token = tf.where(done, 0, tf.argmax(scores, axis=-1, output_type=tf.int32))
        replies = tf.where(tf.equal(positions, t), token[:, None], replies)
        decoder = tf.where(tf.equal(positions, t + 1), token[:, None], decoder)
        return t + 1, decoder, replies, tf.logical_or(done, tf.equal(token, eos_id))

    _, _, replies, _ = tf.while_loop(more, step, (tf.constant(0), decoder, replies, done))
    return replies


class GreedyDecoder:
    """Generates replies token by token, always taking the most likely allowed next token.

    Args:
        model: the Transformer from ``build_transformer``.
        max_output_length: decoder length the model was built with.
        bos_id: id of ``<s>``.
        eos_id: id of ``</s>``.
        pad_id: id of ``<pad>``; neither it nor ``<s>`` is ever generated.
    """

    def __init__(
        self, model: keras.Model, max_output_length: int, bos_id: int, eos_id: int, pad_id: int = 0
    ) -> None:
        self.max_output_length, self.bos_id, self.eos_id = max_output_length, bos_id, eos_id
        max_input_length = model.input["encoder_tokens"].shape[1]
        self._generate = tf.function(
            lambda enc: greedy_token_ids(
                model, enc, max_output_length, bos_id, eos_id, banned=(pad_id, bos_id)
            ),
            input_signature=[tf.TensorSpec([None, max_input_length], tf.int32)],
        )

    def __call__(self, encoder_tokens: np.ndarray) -> np.ndarray:
        """Reply token ids, shape (batch, max_output_length), ``</s>``-terminated where it fits."""
        return self._generate(tf.constant(encoder_tokens, tf.int32)).numpy()
