"""The dialogue SavedModel's ``generate(text) -> reply`` signature: tokenizer, greedy decoding and
detokenizer inside the graph, so that TF Serving (or ``tf.saved_model.load``) answers a question
without any Python code of this project.

The word tokenizer (``trainer.dialogue.tokenizer``) is expressed with TensorFlow string ops:

* lower-casing: ``tf.strings.lower`` with UTF-8 (Unicode case mapping, as ``str.lower``);
* splitting: Python's ``[\\w']+|[^\\w\\s]`` becomes RE2 classes with the same members
  (``\\w`` is ``[\\pL\\pN_]``: letters, numbers, underscore; ``\\s`` is ``str.isspace``'s set):
  every character that is neither a word character nor whitespace is cut out as its own
  token, then the text is split on whitespace;
* ids: a ``StaticHashTable`` from the vocabulary, unknown words to ``<unk>``;
* replies: the vocabulary's words before the first ``</s>``, without ``<pad>`` and ``<s>``,
  joined with spaces, then the space before ``.,!?;:%)]}`` and after ``([{`` removed, as
  ``WordTokenizer.decode`` does.

tests/trainer/dialogue checks that both tokenizers give the same ids and texts.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from trainer.dialogue.model import greedy_token_ids
from trainer.dialogue.tokenizer import WordTokenizer

# Python's str.isspace() characters, as an RE2 class (RE2's \s lacks \v, \x1c-\x1f, \x85 and Unicode spaces).
SPACE = r"[\t\n\x{0b}\f\r\x{1c}-\x{1f}\x{85}\pZ]"
WORD = r"\pL\pN_'"
NO_SPACE_BEFORE = r" ([.,!?;:%)\]}])"
NO_SPACE_AFTER = r"([(\[{]) "


class GraphTokenizer(tf.Module):
    """``WordTokenizer`` as TensorFlow ops (a lookup table and string ops), for the SavedModel.

    Args:
        tokenizer: the trained tokenizer.
        max_input_length: question tokens the model takes (longer questions are cut).
    """

    def __init__(self, tokenizer: WordTokenizer, max_input_length: int) -> None:
        super().__init__(name="tokenizer")
        self.lowercase = tokenizer.lowercase
        self.max_input_length = max_input_length
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = (
            tokenizer.pad_id,
            tokenizer.unk_id,
            tokenizer.bos_id,
            tokenizer.eos_id,
        )
        self.size = tokenizer.size
        self.vocabulary = tf.constant(tokenizer.vocabulary)
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(self.vocabulary, tf.range(tokenizer.size, dtype=tf.int32)),
            default_value=tokenizer.unk_id,
        )

    def split(self, text: tf.Tensor) -> tf.RaggedTensor:
        """Words and punctuation marks of each string: (batch, None) strings."""
        if self.lowercase:
            text = tf.strings.lower(text, encoding="utf-8")
        text = tf.strings.regex_replace(text, SPACE, " ")
        text = tf.strings.regex_replace(text, f"([^{WORD} ])", r" \1 ")
        return tf.strings.split(text)

    def encode(self, text: tf.Tensor) -> tf.Tensor:
        """Encoder token ids, (batch, max_input_length), cut and padded with 0."""
        ids = tf.ragged.map_flat_values(self.table.lookup, self.split(text))
        return ids.to_tensor(default_value=self.pad_id, shape=[None, self.max_input_length])

    def decode(self, ids: tf.Tensor) -> tf.Tensor:
        """Reply texts of (batch, length) ids, up to the first ``</s>``."""
        ids = tf.convert_to_tensor(ids, tf.int32)
        before_end = tf.equal(tf.cumsum(tf.cast(tf.equal(ids, self.eos_id), tf.int32), axis=1), 0)
        keep = (
            before_end
            & tf.not_equal(ids, self.pad_id)
            & tf.not_equal(ids, self.bos_id)
            & tf.greater_equal(ids, 0)
            & tf.less(ids, self.size)
        )
        words = tf.ragged.boolean_mask(
            tf.gather(self.vocabulary, tf.clip_by_value(ids, 0, self.size - 1)), keep
        )
        text = tf.strings.reduce_join(words, axis=1, separator=" ")
        text = tf.strings.regex_replace(text, NO_SPACE_BEFORE, r"\1")
        return tf.strings.regex_replace(text, NO_SPACE_AFTER, r"\1")


def add_generate_endpoint(
    archive: keras.export.ExportArchive,
    model: keras.Model,
    tokenizer: WordTokenizer,
    max_input_length: int,
    max_output_length: int,
) -> None:
    """Register ``generate(text: string[batch]) -> {"reply": string[batch]}`` on ``archive``."""
    graph_tokenizer = GraphTokenizer(tokenizer, max_input_length)
    archive.track(graph_tokenizer)

    def generate(text: tf.Tensor) -> dict[str, tf.Tensor]:
        ids = greedy_token_ids(
            model,
            graph_tokenizer.encode(text),
            max_output_length,
            tokenizer.bos_id,
            tokenizer.eos_id,
            banned=(tokenizer.pad_id, tokenizer.bos_id),
        )
        return {"reply": graph_tokenizer.decode(ids)}

    archive.add_endpoint(
        "generate", generate, input_signature=[tf.TensorSpec([None], tf.string, name="text")]
    )
