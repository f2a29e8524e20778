"""Small, real, deterministic datasets made from data that packages ship (no downloads).

* ``python -m include.sample_data.digits --out digits.zip``: class folders of PNG digits
  from scikit-learn's bundled handwritten-digits images.
* ``python -m include.sample_data.dialogue --out pairs.tsv``: question/response pairs from
  the chatterbot-corpus package's YAML conversations.

Both run in the trainer environment and write the same bytes for the same arguments.
"""
