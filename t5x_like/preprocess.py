"""`python -m t5x_like.preprocess`: clean -> tokenizer -> balanced TFRecord shards + manifest.json.

    python -m t5x_like.preprocess --input='corpus/*.txt' --output_dir=/data/mycorpus [--runner=DirectRunner]
    python -m t5x_like.preprocess --input='corpus/*.jsonl' --output_dir=/data/ordered --order_by=field:difficulty
    python -m t5x_like.preprocess --input='web/*.parquet' --input='web/*.jsonl.zst' --output_dir=/data/web \
        --tokenizer=/data/mycorpus --quality_filters --near_dedup   (docs/data.md)
    python -m t5x_like.preprocess --format=chat --input='sft/*.jsonl' --output_dir=/data/sft \
        --tokenizer=/data/mycorpus [--gin_file=my_template.gin] [--gin.data.ChatTemplate.separator="''"]
    python -m t5x_like.preprocess --format=preference --input='prefs/*.jsonl' --output_dir=/data/dpo \
        --tokenizer=/data/mycorpus --pack_length=257
"""

import dataclasses
import logging
import sys

from absl import app
from absl import flags
import gin
import tensorflow as tf

from t5x_like import cli
from t5x_like.data import chat
from t5x_like.data import data_dir
from t5x_like.data import preprocessing
from t5x_like.data.near_dedup import NearDedupConfig
from t5x_like.data.quality_filters import QualityConfig
from t5x_like.data.text_cleaning import CleaningConfig

try:  # Apache Beam is the optional `beam` extra; only --runner=<a Beam runner> needs it
  from t5x_like.data import beam_runner
except ImportError:
  beam_runner = None


def define_flags():
  f = flags
  f.DEFINE_multi_string("input", None, "Input glob(s): *.jsonl/*.json, plain text (each optionally .gz/.zst), "
                        "*.parquet, *.html, *.tfrecord, or a datasets.save_to_disk folder.")
  f.DEFINE_string("output_dir", None, "DATA_DIR to write (local or gs://...).")
  f.DEFINE_enum("format", "text", ["text", "chat", "preference", "unpaired"], "text: documents; chat: JSON-lines "
                "conversations ({messages: [{role, content}]} or {prompt, completion}) with per-token loss weights; "
                "preference: JSON-lines pairs {prompt, chosen, rejected} for DPO, rows of whole pairs (needs "
                "--pack_length); unpaired: JSON-lines {prompt, completion, label: true|false} for KTO.")
  f.DEFINE_string("tokenizer", None, "Existing tokenizer to use instead of training one: a SentencePiece "
                  ".model, an HF tokenizer.json or an HF folder (tokenizer.json + tokenizer_config.json), "
                  "or a DATA_DIR (its tokenizer). --format=chat needs one: the base model's.")
  f.DEFINE_integer("max_tokens", None, "chat: longest conversation kept, EOS included (default "
                   "--pack_length): longer ones are cut after the last assistant turn that fits, or "
                   "dropped when the first one does not.")
  f.DEFINE_bool("train_on_prompt", False, "chat: loss weight 1 on every token, not only assistant turns.")
  f.DEFINE_string("order_by", "none", "Easy-to-hard order of the train split: 'none' (seeded shards), "
                  "'length' (tokens) or 'field:NAME' (a numeric field of every JSON line); ascending, ties "
                  "by content hash; the input pipeline reads it in that order (docs/data_order.md).")
  cli.define_gin_flags()  # chat: the template, bound as data.ChatTemplate.<field>
  f.DEFINE_integer("vocab_size", 8192, "Tokenizer vocabulary size (capped to what the corpus allows).")
  f.DEFINE_enum("model_type", "bpe", ["bpe", "unigram"], "SentencePiece model type.")
  f.DEFINE_bool("byte_fallback", True, "Encode unknown characters as UTF-8 byte pieces.")
  f.DEFINE_float("character_coverage", 0.9995, "SentencePiece character coverage.")
  f.DEFINE_integer("max_tokenizer_chars", 20_000_000, "Characters used to train the tokenizer.")
  f.DEFINE_integer("num_train_shards", 4, "Number of train shards.")
  f.DEFINE_integer("num_validation_shards", 1, "Number of validation shards.")
  f.DEFINE_float("validation_fraction", 0.01, "Share of documents in the validation split.")
  f.DEFINE_integer("seed", 0, "Seed of the split and the shard assignment.")
  f.DEFINE_string("text_field", "text", "JSON field / Parquet or datasets column / TFRecord feature (seqio: "
                "targets) holding the text (a TFRecord int64 feature: token ids of --tokenizer).")
  f.DEFINE_enum("doc_split", "file", ["file", "blank_line"], "Plain text: one doc per file or paragraph.")
  f.DEFINE_integer("pack_length", None, "Write packed rows of this many tokens (seq_len + 1).")
  f.DEFINE_integer("num_workers", 0, "Tokenization processes (0: CPU count).")
  f.DEFINE_string("cache_dir", "", "Cache directory ('' : OUTPUT_DIR/.cache).")
  f.DEFINE_bool("cache", True, "Reuse cached per-input results.")
  f.DEFINE_enum("non_utf8", "replace", ["replace", "drop"], "Invalid UTF-8 bytes: replace or drop doc.")
  f.DEFINE_enum("strip_html", "auto", ["auto", "always", "never"], "HTML to its visible text (markup, scripts, "
                "styles, comments removed by an HTML parser): auto = *.html inputs and documents that are HTML.")
  f.DEFINE_bool("quality_filters", False, "Heuristic quality filters (repetition, symbol and digit ratios, mean "
                "word length, boilerplate lines); limits: --gin.data.QualityConfig.<field>=...")
  f.DEFINE_bool("near_dedup", False, "Drop near-duplicates (MinHash LSH over word shingles).")
  f.DEFINE_float("near_dedup_threshold", 0.8, "Estimated Jaccard similarity at which a document is a near-duplicate.")
  f.DEFINE_integer("shingle_size", 5, "Words per MinHash shingle.")
  f.DEFINE_integer("min_validation_documents", 16, "Validation split minimum (documents), up to 10% of them.")
  f.DEFINE_integer("min_validation_tokens", 8192, "Validation split minimum (tokens), up to 10% of the documents.")
  f.DEFINE_bool("remove_control_chars", True, "Remove control characters (not \\t, \\n).")
  f.DEFINE_string("unicode_form", "NFC", "Unicode normalisation form ('' to disable).")
  f.DEFINE_enum("whitespace", "basic", ["none", "basic", "collapse"], "Whitespace normalisation.")
  f.DEFINE_integer("min_chars", 1, "Drop documents shorter than this after cleaning.")
  f.DEFINE_bool("dedup", True, "Drop exact duplicate documents.")
  f.DEFINE_string("runner", "local", "local, or a Beam runner: DirectRunner, DataflowRunner, ...")
  f.DEFINE_multi_string("beam_args", None, "Beam pipeline options, e.g. --beam_args=--project=p.")
  return flags.FLAGS


def main(argv) -> None:
  del argv
  fl = flags.FLAGS
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  try:
    cli.register(chat.ChatTemplate, "data")
    cli.register(QualityConfig, "data")
    if fl.gin_file:
      cli.parse_gin(fl.gin_file, fl.gin_bindings, fl.gin_search_paths)
    for binding in [] if fl.gin_file else fl.gin_bindings or []:  # --gin.data.QualityConfig.X=... alone
      try:
        gin.parse_config(binding)
      except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise ValueError(f"gin binding {binding!r}: {str(e).strip().splitlines()[0]}") from e
    cleaning = CleaningConfig(non_utf8=fl.non_utf8, strip_html=fl.strip_html,
                              remove_control_chars=fl.remove_control_chars,
                              unicode_form=fl.unicode_form, whitespace=fl.whitespace,
                              min_chars=fl.min_chars, dedup=fl.dedup,
                              quality=dataclasses.replace(cli.configured(QualityConfig, "data"),
                                                          enabled=fl.quality_filters),
                              near_dedup=NearDedupConfig(enabled=fl.near_dedup, threshold=fl.near_dedup_threshold,
                                                         shingle_size=fl.shingle_size))
    kwargs = dict(vocab_size=fl.vocab_size, tokenizer=fl.tokenizer, model_type=fl.model_type,
                  byte_fallback=fl.byte_fallback, character_coverage=fl.character_coverage,
                  max_tokenizer_chars=fl.max_tokenizer_chars, num_train_shards=fl.num_train_shards,
                  num_validation_shards=fl.num_validation_shards,
                  validation_fraction=fl.validation_fraction, seed=fl.seed,
                  text_field=fl.text_field, doc_split=fl.doc_split, cleaning=cleaning,
                  pack_length=fl.pack_length, num_workers=fl.num_workers or None,
                  cache_dir=fl.cache_dir if fl.cache else None,
                  min_validation_documents=fl.min_validation_documents,
                  min_validation_tokens=fl.min_validation_tokens)
    if fl.runner == "local":
      report = preprocessing.preprocess(fl.input, fl.output_dir, data_format=fl.format,
                                        chat_template=cli.configured(chat.ChatTemplate, "data"),
                                        train_on_prompt=fl.train_on_prompt, max_tokens=fl.max_tokens,
                                        order_by=fl.order_by, **kwargs)
    else:
      if fl.order_by not in ("", "none"):
        raise ValueError(f"--order_by={fl.order_by} runs with --runner=local only (the Beam runner writes "
                         "the seeded shard plan)")
      if fl.format != "text":
        raise ValueError(f"--format={fl.format} runs with --runner=local only (the Beam runner writes text "
                         "DATA_DIRs); chat data sets are small enough for one machine")
      if beam_runner is None:
        raise ValueError(f"--runner={fl.runner} needs Apache Beam: pip install 't5x_like[beam]'")
      report = beam_runner.run(fl.input, fl.output_dir, runner=fl.runner,
                                   pipeline_args=fl.beam_args or (), **kwargs)
  except (ValueError, FileNotFoundError, OSError, tf.errors.OpError) as e:
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise SystemExit(f"preprocess: error: {reason}") from None
  print(data_dir.format_report(report))


if __name__ == "__main__":
  define_flags()
  if {"--help", "-h", "--helpshort", "-?"} & set(sys.argv[1:]):  # absl exits 1 on --help
    print(f"{__doc__}\n\n{flags.FLAGS.main_module_help()}")
    sys.exit(0)
  flags.mark_flags_as_required(["input", "output_dir"])
  app.run(main, argv=cli.rewrite_gin_args(sys.argv))
