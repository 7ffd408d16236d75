"""Chat / SFT data: the template's tokens and loss weights, malformed lines, preprocess → pipeline, exact loss masking."""

import collections
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
import tokenizers

from t5x_like.data import chat
from t5x_like.data import chat_synth
from t5x_like.data import input_pipeline as ip
from t5x_like.data import packing
from t5x_like.data import preprocessing as pp
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.training.objectives import language_model

ONE = dict(process_index=0, process_count=1)
SEQ = 56
MULTI_TURN = {"messages": [{"role": "system", "content": "table: a=self b=path"},
                           {"role": "user", "content": "value of a"},
                           {"role": "assistant", "content": "self"},
                           {"role": "user", "content": "value of b"},
                           {"role": "assistant", "content": "path"}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  texts = [" ".join(chat_synth.WORDS) + "\nreverse: value of table: a=b c=d\n"] * 20
  return tokenizer_lib.train_tokenizer(texts, str(tmp_path_factory.mktemp("tok") / "tok.model"), vocab_size=360,
                                       num_threads=1)


@pytest.fixture(scope="module")
def enc(tok):
  return chat.ChatEncoder(tok)


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
  """Generated conversations: reverse (prompt/completion), lookup (system table) and a two-answer conversation."""
  root = tmp_path_factory.mktemp("raw")
  chat_synth.write_synthetic_chat(str(root), "reverse", num_train=24, num_test=2, seed=0)
  chat_synth.write_synthetic_chat(str(root), "lookup", num_train=12, num_test=2, seed=0)
  (root / "multi.jsonl").write_text(json.dumps(MULTI_TURN) + "\n")
  return [str(root / "reverse_train.jsonl"), str(root / "lookup_train.jsonl"), str(root / "multi.jsonl")]


def lines_of(paths):
  return [json.loads(line) for p in paths for line in open(p, encoding="utf-8")]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tok, raw):
  out = str(tmp_path_factory.mktemp("chat") / "data")
  report = pp.preprocess(raw, out, tokenizer=tok.path, data_format="chat", num_train_shards=1,
                         validation_fraction=0.2, progress=False, cache_dir=None)
  return out, report


def test_single_turn_tokens_and_weights(tok, enc):
  doc = enc.render(chat.parse_line(json.dumps({"prompt": "reverse: self path", "completion": "path self"})))
  u, a, e = (chat.token_id(tok, m) for m in ("<|user|>", "<|assistant|>", "<|end|>"))
  prompt, answer, newline = tok.encode("reverse: self path"), tok.encode("path self"), tok.encode("\n")
  assert newline == [4]  # "\n" is one reserved piece
  assert doc.ids.tolist() == [u, *prompt, e, 4, a, *answer, e, 4, tok.eos_id]
  assert doc.weights.tolist() == [0] * (len(prompt) + 4) + [1] * (len(answer) + 1) + [0, 0]
  assert tok.decode(doc.ids[doc.weights == 1]) == "path self<|end|>"


def test_multi_turn_weights_every_assistant_turn(tok, enc):
  doc = enc.render(chat.parse_conversation(MULTI_TURN))
  assert tok.decode(doc.ids[doc.weights == 1]) == "self<|end|>path<|end|>"
  assert tok.decode(doc.ids) == ("<|system|>table: a=self b=path<|end|>\n<|user|>value of a<|end|>\n"
                                 "<|assistant|>self<|end|>\n<|user|>value of b<|end|>\n<|assistant|>path<|end|>\n")
  assert doc.roles == ("system", "user", "assistant", "user", "assistant")
  all_ones = chat.ChatEncoder(tok, train_on_prompt=True).render(chat.parse_conversation(MULTI_TURN))
  assert all_ones.ids.tolist() == doc.ids.tolist() and all_ones.weights.tolist() == [1] * len(doc.ids)


def test_template_options_prompt_and_completion(tok):
  t = chat.ChatTemplate(separator="", default_system="be brief")
  e = chat.ChatEncoder(tok, t)
  doc = e.render([("user", "value of a"), ("assistant", "self")])
  assert tok.decode(doc.ids) == "<|system|>be brief<|end|><|user|>value of a<|end|><|assistant|>self<|end|>"
  prompt = e.prompt_ids([("user", "value of a")])
  assert prompt == doc.ids[:len(prompt)].tolist() and tok.decode(prompt).endswith("<|end|><|assistant|>")
  assert e.completion_text(doc.ids[len(prompt):]) == "self"
  assert chat.prompt_and_reference(chat.parse_conversation(MULTI_TURN))[1] == "path"


def test_missing_marker_is_a_one_line_error_naming_marker_and_tokenizer(tok):
  with pytest.raises(ValueError) as e:
    chat.ChatEncoder(tok, chat.ChatTemplate(end="<|eot_id|>"))
  assert "'<|eot_id|>'" in str(e.value) and tok.path in str(e.value) and "\n" not in str(e.value)
  assert chat.token_id(tok, "<|eot_id|>") is None and chat.token_id(tok, "<|end|>") == 8


def test_hf_tokenizer_json_through_the_same_adapter(tmp_path):
  hf = tokenizers.Tokenizer(tokenizers.models.BPE())
  hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = tokenizers.decoders.ByteLevel()
  hf.train_from_iterator([" ".join(chat_synth.WORDS) + "\nreverse: value of"] * 5, tokenizers.trainers.BpeTrainer(
      vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  hf.add_special_tokens(["<|endoftext|>"])
  hf.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
  with pytest.raises(ValueError, match=f"marker '<\\|system\\|>' .* tokenizer '{tmp_path}/tokenizer.json'"):
    chat.ChatEncoder(tokenizer_lib.load(str(tmp_path)))
  hf.add_special_tokens(list(tokenizer_lib.CHAT_TOKENS))
  hf.save(str(tmp_path / "tokenizer.json"))
  tok = tokenizer_lib.load(str(tmp_path))
  doc = chat.ChatEncoder(tok).render(chat.parse_conversation(MULTI_TURN))
  a, e = hf.token_to_id("<|assistant|>"), hf.token_to_id("<|end|>")
  assert doc.ids[doc.weights == 1].tolist() == [*hf.encode("self").ids, e, *hf.encode("path").ids, e]
  assert doc.ids.tolist().count(a) == 2 and doc.ids[-1] == tok.eos_id == hf.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("line,reason", [
    ("{not json", "bad_json"),
    ("[1, 2]", "wrong_shape"),
    ('{"prompt": "hi"}', "wrong_shape"),                      # missing key
    ('{"messages": [{"role": "user"}]}', "wrong_shape"),
    ('{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown_role"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no_assistant"),
    ('{"prompt": "x", "completion": "  "}', "empty_content"),
])
def test_malformed_line_reasons(line, reason):
  with pytest.raises(chat.MalformedLine) as e:
    chat.parse_line(line)
  assert e.value.reason == reason


def test_turn_boundary_truncation(tok, enc):
  doc = enc.render(chat.parse_conversation(MULTI_TURN))
  first_answer = doc.turn_ends[2] + 1  # through the first assistant turn, plus EOS
  cut = chat.truncate(doc, len(doc.ids) - 1, tok.eos_id)
  assert len(cut.ids) == first_answer and cut.ids[-1] == tok.eos_id
  assert cut.ids[:-1].tolist() == doc.ids[:first_answer - 1].tolist() and cut.roles[-1] == "assistant"
  assert chat.truncate(doc, first_answer - 1, tok.eos_id) is None
  assert chat.truncate(doc, len(doc.ids), tok.eos_id) is doc


def test_preprocess_counts_and_names_malformed_lines(tmp_path, tok, caplog):
  good = json.dumps({"prompt": "value of a", "completion": "self"})
  lines = [good, "{bad", "", '{"messages": [{"role": "user", "content": "x"}]}', good,
           json.dumps({"prompt": "x <|end|> y", "completion": "z"}), json.dumps(MULTI_TURN),
           '{"messages": [{"role": "robot", "content": "x"}]}']
  path = tmp_path / "in.jsonl"
  path.write_text("\n".join(lines) + "\n")
  full = len(chat.ChatEncoder(tok).render(chat.parse_conversation(MULTI_TURN)).ids)
  with caplog.at_level(logging.WARNING):
    report = pp.preprocess([str(path)], str(tmp_path / "o"), tokenizer=tok.path, data_format="chat",
                           max_tokens=full - 1, validation_fraction=0.0, progress=False, cache_dir=None)
  assert report["dropped"] == {"duplicate": 1, "malformed_bad_json": 1, "malformed_marker_in_content": 1,
                               "malformed_no_assistant": 1, "malformed_unknown_role": 1}
  assert report["changed"] == {"truncated": 1}
  assert report["documents_in"] == 7 and report["documents_out"] == 2
  named = [m.split(": ")[0:2] for m in report["malformed_lines"]]
  assert named == [[f"{path}:2", "bad_json"], [f"{path}:4", "no_assistant"], [f"{path}:6", "marker_in_content"],
                   [f"{path}:8", "unknown_role"]]
  assert f"{path}:2" in caplog.text and f"{path}:8" in caplog.text
  manifest = ip.load_manifest(str(tmp_path / "o"))
  assert manifest["splits"]["train"]["max_document_tokens"] < full


def test_data_dir_manifest_and_documents(chat_dir, raw, enc):
  out, report = chat_dir
  manifest = ip.load_manifest(out)
  assert manifest["format"] == "chat" and manifest["features"] == ["tokens", "weights"]
  assert manifest["chat_template"] == {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>",
                                       "end": "<|end|>", "separator": "\n", "default_system": "",
                                       "prefix": ""}
  assert chat.template_from_manifest(manifest) == chat.ChatTemplate()
  examples = lines_of(raw)
  assert report["documents_out"] == len(examples) == 37 and report["dropped"] == {}
  assert 0 < manifest["splits"]["validation"]["num_documents"] < 37
  spec = {k: tf.io.RaggedFeature(tf.int64) for k in ("tokens", "weights")}
  stored = []
  for split in ("train", "validation"):
    for s in manifest["splits"][split]["shards"]:
      for r in tf.data.TFRecordDataset(os.path.join(out, s["path"])):
        f = tf.io.parse_example(r[None], spec)
        stored.append((tuple(f["tokens"][0].numpy()), tuple(f["weights"][0].numpy())))
  rendered = [enc.render(chat.parse_conversation(e)) for e in examples]
  assert collections.Counter(stored) == collections.Counter((tuple(d.ids), tuple(d.weights)) for d in rendered)


def documents_of_batches(batches, pad_id=0):
  """(tokens, weight of predicting each token) of every conversation in pipeline batches (weights[0] = 0)."""
  docs = []
  for b in batches:
    b = {k: v.numpy() for k, v in b.items()}
    length = b["inputs"].shape[1]
    for r in range(b["inputs"].shape[0]):
      seg = b["segment_ids"][r]
      for s in sorted(set(seg[seg > 0].tolist())):
        cols = np.flatnonzero(seg == s)
        assert np.array_equal(cols, np.arange(cols[0], cols[-1] + 1))
        assert np.array_equal(b["positions"][r, cols], np.arange(len(cols)))
        tokens, weights = b["inputs"][r, cols].tolist(), b["weights"][r, cols].tolist()
        if cols[-1] == length - 1 and b["targets"][r, -1] != pad_id:  # the document ends the row
          tokens.append(int(b["targets"][r, -1]))
        else:
          assert weights.pop() == 0  # predicting what follows a document's EOS is never weighted
        docs.append((tokens, [0.0] + weights))
  return docs


def test_pipeline_weights_are_one_exactly_on_assistant_targets(chat_dir, raw, tok):
  out, _ = chat_dir
  ds = ip.make_dataset(out, "train", batch_size=3, seq_len=SEQ, shuffle=False, repeat=False, **ONE)
  docs = documents_of_batches(ds)
  end = chat.token_id(tok, "<|end|>")
  expected = collections.Counter()  # from the JSON and the tokenizer alone: assistant contents and end markers
  for e in lines_of(raw):
    turns = e.get("messages") or [{"role": "assistant", "content": e["completion"]}]
    expected[tuple(t for m in turns if m["role"] == "assistant" for t in tok.encode(m["content"]) + [end])] += 1
  assert len(docs) == ip.load_manifest(out)["splits"]["train"]["num_documents"] > 20
  learned = collections.Counter()
  for tokens, weights in docs:
    assert tokens[-1] == tok.eos_id and set(weights) <= {0.0, 1.0}
    learned[tuple(t for t, w in zip(tokens, weights) if w == 1.0)] += 1
  assert not learned - expected  # every document's weighted targets are exactly its assistant turns


def test_prepacked_rows_equal_pipeline_packing_and_resume(chat_dir, raw, tok, tmp_path):
  out, _ = chat_dir
  packed = str(tmp_path / "packed")
  pp.preprocess(raw, packed, tokenizer=out, data_format="chat", num_train_shards=1, validation_fraction=0.2,
                pack_length=SEQ + 1, progress=False, cache_dir=None)  # --tokenizer=DATA_DIR
  assert ip.load_manifest(packed)["tokenizer_sha256"] == tok.sha256
  common = dict(batch_size=2, seq_len=SEQ, shuffle=False, repeat=False, **ONE)
  a, b = list(ip.make_dataset(out, "train", **common)), list(ip.make_dataset(packed, "train", **common))
  assert len(a) == len(b) > 2
  for x, y in zip(a, b):
    assert all(np.array_equal(x[k].numpy(), y[k].numpy()) for k in x)
  with pytest.raises(ValueError, match=f"pre-packed to {SEQ + 1} tokens: read it with seq_len={SEQ}"):
    ip.make_dataset(packed, "train", **dict(common, seq_len=SEQ // 2))
  ds = ip.make_dataset(out, "train", batch_size=2, seq_len=SEQ, seed=1, shuffle_buffer=4, **ONE)
  it = iter(ds)
  next(it)
  path = tf.train.Checkpoint(iterator=it).write(str(tmp_path / "it"))
  want = [next(it) for _ in range(4)]  # across the end of an epoch (the scan's row buffer is in the checkpoint)
  fresh = iter(ds)
  tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
  for w in want:
    g = next(fresh)
    assert all(np.array_equal(w[k].numpy(), g[k].numpy()) for k in w)


def test_pack_documents_np_hand_made():
  rows = packing.pack_documents_np([([5, 6, 1], [0, 1, 0]), ([7, 1], [1, 0]), ([8, 8, 1], [1, 1, 0])], 5, 0)
  assert rows.tolist() == [[[5, 6, 1, 7, 1], [1, 1, 1, 2, 2], [0, 1, 2, 0, 1], [0, 1, 0, 1, 0]],
                           [[8, 8, 1, 0, 0], [1, 1, 1, 0, 0], [0, 1, 2, 0, 0], [1, 1, 0, 0, 0]]]
  f = {k: v.numpy().tolist() for k, v in packing.row_features(tf.constant(rows)).items()}
  assert f["weights"] == [[1, 0, 0, 0], [1, 0, 0, 0]]  # row 1: 6 (w1); 1 (w0); 7 crosses; 1 (w0)
  assert f["targets"][0] == [6, 1, 7, 1]


def test_synthetic_tasks_are_deterministic_and_held_out(tmp_path):
  a = chat_synth.write_synthetic_chat(str(tmp_path / "a"), "lookup", num_train=50, num_test=20, seed=3)
  b = chat_synth.write_synthetic_chat(str(tmp_path / "b"), "lookup", num_train=50, num_test=20, seed=3)
  assert [open(p).read() for p in a] == [open(p).read() for p in b]
  train, test = (set(open(p).read().splitlines()) for p in a)
  assert len(train) == 50 and len(test) == 20 and not train & test
  for line in test:
    messages = chat.parse_line(line)
    table = dict(kv.split("=") for kv in messages[0][1].removeprefix("table: ").split())
    assert table[messages[1][1].removeprefix("value of ")] == messages[2][1]
  r = chat_synth.make_examples("reverse", 5, seed=1)
  assert all(e["completion"].split() == e["prompt"].removeprefix("reverse: ").split()[::-1] for e in r)


@pytest.fixture(scope="module")
def loss_and_grad(tok):
  cfg = model_lib.GPTConfig(vocab_size=tok.vocab_size, num_layers=1, num_heads=2, d_model=32, d_ff=64,
                            max_len=64, dtype="float32")
  model = model_lib.GPT(cfg)
  params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
  objective = language_model.LanguageModel(apply_fn=model.apply)

  @jax.jit
  def fn(batch):
    (loss, weight), grads = jax.value_and_grad(lambda p: objective.loss(p, batch)[:2], has_aux=True)(params)
    return loss, weight, grads
  return lambda batch: jax.device_get(fn({k: jnp.asarray(v) for k, v in batch.items()}))


def test_loss_masking_is_exact(chat_dir, loss_and_grad):
  out, _ = chat_dir
  batch = {k: v.numpy() for k, v in next(iter(ip.make_dataset(out, "train", batch_size=6, seq_len=SEQ,
                                                               shuffle=False, repeat=False, **ONE))).items()}
  w = batch["weights"]
  assert 0 < w.sum() < (batch["segment_ids"] > 0).sum() / 3  # most targets are prompt or template
  loss, weight, grads = loss_and_grad(batch)
  rng = np.random.default_rng(0)
  prompt = dict(batch, targets=np.where(w == 0, rng.integers(0, 300, w.shape), batch["targets"]).astype(np.int32))
  assert (prompt["targets"] != batch["targets"]).sum() > 100
  loss2, weight2, grads2 = loss_and_grad(prompt)
  assert loss2 == loss and weight2 == weight
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), grads, grads2)
  r, c = np.argwhere(w == 1)[0]
  answer = dict(batch, targets=batch["targets"].copy())
  answer["targets"][r, c] = (answer["targets"][r, c] + 1) % 300
  loss3, _, grads3 = loss_and_grad(answer)
  assert abs(loss3 - loss) > 1e-3
  assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads3))) > 1e-4


def test_packed_and_unpacked_give_the_same_loss(chat_dir, loss_and_grad):
  out, _ = chat_dir
  rows = 6
  packed = {k: v.numpy() for k, v in next(iter(ip.make_dataset(out, "train", batch_size=rows, seq_len=SEQ,
                                                                shuffle=False, repeat=False, **ONE))).items()}
  docs = [(np.array(t), np.array(w, np.int32)) for t, w in documents_of_batches([{
      k: tf.constant(v) for k, v in packed.items()}])]  # the same conversations, one per row below
  assert len(docs) > rows  # several conversations share a row
  total, total_weight = 0.0, 0.0
  for start in range(0, len(docs), rows):
    unpacked = np.concatenate([packing.pack_documents_np([d], SEQ + 1, 0) for d in docs[start:start + rows]])
    unpacked = np.concatenate([unpacked, np.zeros([rows - len(unpacked), 4, SEQ + 1], np.int32)])
    loss, weight, _ = loss_and_grad({k: v.numpy() for k, v in packing.row_features(tf.constant(unpacked)).items()})
    total, total_weight = total + loss, total_weight + weight
  loss, weight, _ = loss_and_grad(packed)
  assert weight == total_weight > 0
  np.testing.assert_allclose(loss, total, rtol=2e-6)


# The CLI (a gin-bound template field, --tokenizer=DATA_DIR, malformed lines counted): test_preprocess.py's
# test_cli_chat_quality_filters_and_bad_input.


def test_template_marker_error_through_preprocess_names_the_data_dir_tokenizer(chat_dir, raw, tmp_path):
  out, _ = chat_dir
  with pytest.raises(ValueError) as e:  # the template's marker error through preprocess, --tokenizer=DATA_DIR
    pp.preprocess([raw[2]], str(tmp_path / "o2"), tokenizer=out, data_format="chat",
                  chat_template=chat.ChatTemplate(end="<|eot|>"), progress=False, cache_dir=None)
  assert str(e.value) == ("chat template marker '<|eot|>' (ChatTemplate.end) is not a single token of the "
                          f"tokenizer '{out}/tokenizer.model' (nor text that starts with one of its special tokens): "
                          "use a tokenizer that reserves it, or bind data.ChatTemplate.end")


def test_the_input_pipelines_functions_are_traced_without_autograph(chat_dir, corpus, tmp_path):
  """tf.data runs AutoGraph over every function it is given unless told not to (input_pipeline.graph_fn): building
  and reading the text, chat, shuffled, padded-evaluation, mixed and two-stream pipelines converts none. The same
  count sees a plain `map` converted, so the check cannot pass for want of a detector."""
  import shutil  # pylint: disable=g-import-not-at-top
  from unittest import mock  # pylint: disable=g-import-not-at-top
  from tensorflow.python.autograph.impl import api  # pylint: disable=g-import-not-at-top  (TF internals: AutoGraph's converter)
  from t5x_like.data import mixture  # pylint: disable=g-import-not-at-top
  from t5x_like.parallel import global_batch  # pylint: disable=g-import-not-at-top

  def conversions(build) -> int:
    with mock.patch.object(api, "_convert_actual", wraps=api._convert_actual) as convert:  # pylint: disable=protected-access
      next(iter(build()))
    return convert.call_count

  assert conversions(lambda: tf.data.Dataset.range(3).map(lambda x: x + 1)) > 0
  for split, shuffle, repeat in (("train", True, True), ("validation", False, False)):
    for data_dir in (chat_dir[0], corpus):
      assert conversions(lambda: ip.make_dataset(data_dir, split, batch_size=4, seq_len=SEQ, shuffle=shuffle,
                                                 repeat=repeat, **ONE)) == 0, (data_dir, split)
  copy = str(tmp_path / "copy")
  shutil.copytree(corpus, copy)
  mixed = mixture.Mixture.create({corpus: 1.0, copy: 1.0})
  assert conversions(lambda: mixed.make_dataset("train", batch_size=4, seq_len=SEQ)) == 0
  streams = lambda stream_index, num_streams, batch_size: ip.make_dataset(
      corpus, "train", batch_size=batch_size, seq_len=SEQ, process_index=stream_index, process_count=num_streams)
  for num_streams, process_index, process_count in ((2, 0, 1), (1, 1, 2)):  # two streams zipped; a process's rows
    assert conversions(lambda: global_batch.process_rows(streams, num_streams=num_streams, global_batch_size=4,
                                                         process_index=process_index,
                                                         process_count=process_count)) == 0
