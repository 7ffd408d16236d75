"""HF tokenizer.json beside SentencePiece: ids equal to `tokenizers` / transformers, special and pad ids,
preprocess with --tokenizer=tokenizer.json, save_hf round trips through AutoTokenizer, bad input."""

import collections
import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
import pytest
import tensorflow as tf
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
import transformers

from t5x_like.data import input_pipeline
from t5x_like.data import packing
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.data import tokenizer_formats
from t5x_like.data.text_cleaning import CleaningConfig
from t5x_like.model import decoder as model_lib
from t5x_like.inference import text
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import optimizer as optimizer_lib
from tests.decode_reference import generate_by_recompute

CODE = ('import os\n\n\nclass Reader:\n    """Reads a file."""\n\n    def __init__(self, path):\n'
        '        self.path = path  # keep it\n\n    def read(self):\n\tif not self.path:\n\t\treturn ""\n'
        '        with open(self.path, encoding="utf-8") as f:\n            return f.read()\n')
TRAIN_TEXTS = [CODE, "The quick brown fox jumps over the lazy dog. " * 3, "héllo wörld, ça va? naïve café ☃",
               "for i in range(10):\n    print(i, i ** 2)\n", "x = {'a': [1, 2, 3]}  # dict\n"]
# Code with indentation and tabs, unicode outside the training text, long space runs, the chat markers,
# literal special-token strings, an empty string.
TEXTS = [CODE, "def f(x):\n        return  x\t# é ☃ 你好 🚀\n", " " * 37 + "deep\n", "\t\t\tx\n\n\n",
         "<|user|>hi<|end|>\n<|assistant|>sure  thing<|end|>\n", "a <s> b </s> c <unk> <pad> <|endoftext|>",
         "<|begin_of_text|>text<|end_of_text|>", "ＡＢＣ ﬁ ① \x07\u200b", "", "1234567 + 89 = ?"]
AS_IS = CleaningConfig(remove_control_chars=False, unicode_form="", whitespace="none", dedup=False)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|reserved_special_token_2|>", "<|eot_id|>")


def byte_level_bpe(vocab_size, **model_kwargs):
  """A byte-level BPE trained on TRAIN_TEXTS, special tokens to be appended after its vocabulary."""
  tok = tokenizers.Tokenizer(models.BPE(**model_kwargs))
  tok.decoder = decoders.ByteLevel()
  return tok, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)


def write_json(path, value):
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
  """GPT-2-shaped: byte-level BPE, one special token <|endoftext|> (the last id) that is BOS, EOS and UNK."""
  folder = str(tmp_path_factory.mktemp("gpt2"))
  tok, trainer = byte_level_bpe(400)
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  tok.train_from_iterator(TRAIN_TEXTS, trainer)
  tok.add_special_tokens(["<|endoftext|>"])
  tok.save(os.path.join(folder, "tokenizer.json"))
  write_json(os.path.join(folder, "tokenizer_config.json"),
             {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>", "model_max_length": 1024})
  return folder


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
  """Llama-3-shaped: split regex + byte-level BPE, special tokens after the vocabulary, no pad token."""
  folder = str(tmp_path_factory.mktemp("llama3"))
  tok, trainer = byte_level_bpe(420, ignore_merges=True)
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.train_from_iterator(TRAIN_TEXTS, trainer)
  tok.add_special_tokens(list(LLAMA3_SPECIALS))
  bos = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                     special_tokens=[("<|begin_of_text|>", bos)])
  tok.save(os.path.join(folder, "tokenizer.json"))
  write_json(os.path.join(folder, "tokenizer_config.json"),
             {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|end_of_text|>", "chat_template": "{{ messages }}"})
  write_json(os.path.join(folder, "config.json"),
             {"bos_token_id": bos, "eos_token_id": [tok.token_to_id("<|eot_id|>"), bos]})  # the config wins
  return folder


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
  """Our own kind: SentencePiece BPE, identity normalisation, no dummy prefix, byte fallback, chat markers."""
  path = str(tmp_path_factory.mktemp("sp") / "tokenizer.model")
  return tokenizer_lib.train_tokenizer(TRAIN_TEXTS * 4, path, vocab_size=340, num_threads=1)


def reference(folder):
  return tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_ids_equal_tokenizers_and_transformers_on_varied_text(kind, request):
  folder = request.getfixturevalue(f"{kind}_dir")
  auto = transformers.AutoTokenizer.from_pretrained(folder)
  for tok in (tokenizer_lib.load(folder), tokenizer_lib.load(os.path.join(folder, "tokenizer.json"))):
    assert isinstance(tok, tokenizer_lib.HFTokenizer) and tok.filename == "tokenizer.json"
    for text in TEXTS:
      ids = tok.encode(text)
      assert ids == reference(folder).encode(text, add_special_tokens=False).ids, text
      assert ids == auto(text, add_special_tokens=False).input_ids, text
    assert tok.encode(TEXTS) == [tok.encode(t) for t in TEXTS]  # the batch path


def test_special_ids_from_the_config_files_and_the_pad_rule(gpt2_dir, llama3_dir):
  gpt2, raw = tokenizer_lib.load(gpt2_dir), reference(gpt2_dir)
  end = raw.token_to_id("<|endoftext|>")
  assert end == raw.get_vocab_size() - 1 == gpt2.vocab_size - 1
  # BOS = EOS = UNK and no other special token: the pad is one past the vocabulary.
  assert (gpt2.bos_id, gpt2.eos_id, gpt2.unk_id, gpt2.pad_id) == (end, end, end, gpt2.vocab_size)
  llama, raw = tokenizer_lib.load(llama3_dir), reference(llama3_dir)
  assert llama.vocab_size == raw.get_vocab_size(with_added_tokens=True)
  assert llama.bos_id == raw.token_to_id("<|begin_of_text|>")
  assert llama.eos_id == raw.token_to_id("<|end_of_text|>")  # tokenizer_config.json, not config.json
  assert llama.unk_id == -1
  assert llama.pad_id == raw.token_to_id("<|reserved_special_token_2|>")  # the highest reserved token
  assert llama.token_to_id("<|eot_id|>") == raw.token_to_id("<|eot_id|>")
  assert llama.token_to_id("<|user|>") is None


def test_special_ids_without_config_files_and_from_config_json(gpt2_dir, llama3_dir, tmp_path):
  for name, src in (("gpt2", gpt2_dir), ("llama3", llama3_dir)):
    os.makedirs(tmp_path / name)
    with open(os.path.join(src, "tokenizer.json"), "rb") as f:
      (tmp_path / name / "tokenizer.json").write_bytes(f.read())
  bare = tokenizer_lib.load(str(tmp_path / "gpt2" / "tokenizer.json"))
  end = bare.token_to_id("<|endoftext|>")
  assert (bare.bos_id, bare.eos_id, bare.unk_id, bare.pad_id) == (-1, end, -1, bare.vocab_size)
  bare = tokenizer_lib.load(str(tmp_path / "llama3"))  # BOS from the post-processor, EOS by its name
  assert (bare.bos_id, bare.eos_id) == (bare.token_to_id("<|begin_of_text|>"), bare.token_to_id("<|end_of_text|>"))
  raw = reference(str(tmp_path / "llama3"))
  raw.add_special_tokens(["<|finetune_right_pad_id|>"])  # as Llama-3.1 has: named as padding, so it pads
  os.makedirs(tmp_path / "llama31")
  raw.save(str(tmp_path / "llama31" / "tokenizer.json"))
  assert tokenizer_lib.load(str(tmp_path / "llama31")).pad_id == raw.token_to_id("<|finetune_right_pad_id|>")
  eot = bare.token_to_id("<|eot_id|>")
  write_json(tmp_path / "llama3" / "config.json", {"eos_token_id": [eot, 1], "pad_token_id": eot})
  tok = tokenizer_lib.load(str(tmp_path / "llama3"))
  assert tok.eos_id == eot  # the first of config.json's list; a pad equal to EOS is replaced by the rule
  assert tok.pad_id == bare.token_to_id("<|reserved_special_token_2|>")
  write_json(tmp_path / "llama3" / "special_tokens_map.json", {"pad_token": {"content": "<|start_header_id|>"}})
  assert tokenizer_lib.load(str(tmp_path / "llama3")).pad_id == bare.token_to_id("<|start_header_id|>")


def test_decode_stops_at_eos_and_drops_padding(gpt2_dir, llama3_dir, sentencepiece):
  for tok in (tokenizer_lib.load(gpt2_dir), tokenizer_lib.load(llama3_dir), sentencepiece):
    ids = tok.encode(CODE)
    assert tok.decode(ids) == CODE
    noisy = [tok.pad_id] + ids[:5] + [tok.pad_id, tok.vocab_size + 3] + ids[5:] + [tok.eos_id] + ids
    assert tok.decode(np.array(noisy)) == CODE


def test_sentencepiece_without_a_pad_id(tmp_path):
  """Llama's SentencePiece model has pad_id -1: with byte fallback <unk> never occurs and pads; without, BOS."""
  fallback = tokenizer_lib.train_tokenizer(TRAIN_TEXTS, str(tmp_path / "a.model"), vocab_size=340, pad_id=-1,
                                           num_threads=1)
  assert (fallback.pad_id, fallback.unk_id, fallback.eos_id) == (2, 2, 1)
  plain = tokenizer_lib.train_tokenizer(TRAIN_TEXTS, str(tmp_path / "b.model"), vocab_size=120, pad_id=-1,
                                        byte_fallback=False, num_threads=1)
  assert plain.encode("\u4e2d")[0] == plain.unk_id  # unknown characters do become <unk> here
  assert (plain.pad_id, plain.bos_id) == (3, 3)
  assert tokenizer_lib.load(tmp_path / "a.model").pad_id == 2


@pytest.fixture(scope="module")
def gpt2_data(gpt2_dir, tmp_path_factory):
  """A pre-packed DATA_DIR written with the GPT-2-shaped tokenizer.json (its pad id is outside the vocabulary)."""
  root = tmp_path_factory.mktemp("gpt2_data")
  for i, text in enumerate(TEXTS[:8]):
    (root / f"doc{i}.txt").write_text(text + "\n" + CODE * (i % 3), encoding="utf-8")
  out = str(root / "ds")
  preprocessing.preprocess([str(root / "*.txt")], out, tokenizer=os.path.join(gpt2_dir, "tokenizer.json"),
                           num_train_shards=1, num_validation_shards=1, validation_fraction=0.2, pack_length=24,
                           num_workers=1, cache_dir=None, progress=False, cleaning=AS_IS)
  return out


def test_preprocess_with_tokenizer_json_writes_its_ids_and_masks_only_padding(gpt2_dir, gpt2_data):
  tok, raw = tokenizer_lib.load(gpt2_dir), reference(gpt2_dir)
  manifest = input_pipeline.load_manifest(gpt2_data, verify="sha256")
  assert manifest["tokenizer"] == "tokenizer.json"
  with open(os.path.join(gpt2_dir, "tokenizer.json"), "rb") as f:
    assert manifest["tokenizer_sha256"] == hashlib.sha256(f.read()).hexdigest()
  assert (manifest["vocab_size"], manifest["eos_id"], manifest["pad_id"]) == (tok.vocab_size, tok.eos_id, tok.vocab_size)
  stored = tokenizer_lib.load(gpt2_data)  # the DATA_DIR's copy has the same ids and special ids
  assert (stored.sha256, stored.eos_id, stored.pad_id) == (tok.sha256, tok.eos_id, tok.pad_id)
  # The shards hold exactly the HF tokenizer's ids of each cleaned document, each followed by EOS.
  docs = [open(p, encoding="utf-8").read() for p in tf.io.gfile.glob(os.path.join(os.path.dirname(gpt2_data), "*.txt"))]
  want = collections.Counter(t for d in docs for t in raw.encode(d, add_special_tokens=False).ids + [tok.eos_id])
  rows = {}
  for split, entry in manifest["splits"].items():
    path = os.path.join(gpt2_data, entry["shards"][0]["path"])
    rows[split] = np.concatenate([packing.parse_packed(r[None], 24, manifest["packed_dtype"]).numpy()
                                  for r in tf.data.TFRecordDataset(path)])               # (R, 3, 24)
  tokens = np.concatenate([r[:, packing.TOKENS] for r in rows.values()])
  segments = np.concatenate([r[:, packing.SEGMENTS] for r in rows.values()])
  assert collections.Counter(tokens[segments > 0].tolist()) == want
  assert set(tokens[segments == 0].tolist()) == {tok.pad_id}  # padding: the last row's tail of each shard
  # Re-packed to another length, every target that continues its document in the row has weight 1.
  stream = rows["train"][:, packing.TOKENS][rows["train"][:, packing.SEGMENTS] > 0]
  ds = input_pipeline.make_dataset(gpt2_data, "train", batch_size=2, seq_len=9, shuffle=False, repeat=False,
                                   process_index=0, process_count=1)
  weights = sum(float(b["weights"].numpy().sum()) for b in ds)
  padded = np.full(-(-len(stream) // 10) * 10, -1)
  padded[:len(stream)] = stream
  pairs = padded.reshape(-1, 10)
  assert weights == np.sum((pairs[:, :-1] != tok.eos_id) & (pairs[:, 1:] >= 0))


def test_preprocess_with_an_hf_folder_without_pad(llama3_dir, sentencepiece, tmp_path):
  (tmp_path / "a.txt").write_text(CODE, encoding="utf-8")
  out = str(tmp_path / "ds")
  preprocessing.preprocess([str(tmp_path / "a.txt")], out, tokenizer=llama3_dir, validation_fraction=0.0,
                           num_train_shards=1, num_workers=1, cache_dir=None, progress=False)
  manifest = input_pipeline.load_manifest(out)
  tok = tokenizer_lib.load(llama3_dir)
  assert (manifest["eos_id"], manifest["pad_id"], manifest["bos_id"]) == (tok.eos_id, tok.pad_id, tok.bos_id)
  stored = tokenizer_lib.load(os.path.join(out, manifest["tokenizer"]))
  assert (stored.eos_id, stored.pad_id, stored.bos_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
  spec = {"tokens": tf.io.RaggedFeature(tf.int64)}
  records = [tf.io.parse_example(r[None], spec)["tokens"][0].numpy().tolist()
             for r in tf.data.TFRecordDataset(os.path.join(out, manifest["splits"]["train"]["shards"][0]["path"]))]
  assert records == [reference(llama3_dir).encode(CODE, add_special_tokens=False).ids + [tok.eos_id]]
  tokenizer_lib.check_wrote(tok, manifest, out)  # evaluate --tokenizer: the model's tokenizer wrote the data
  with pytest.raises(ValueError, match="did not write DATA_DIR .*tokenizer_sha256"):
    tokenizer_lib.check_wrote(sentencepiece, manifest, out)


def auto_matches(tok, folder):
  """AutoTokenizer loaded from `folder` gives `tok`'s ids and special ids."""
  auto = transformers.AutoTokenizer.from_pretrained(folder)
  for text in TEXTS:
    assert auto(text, add_special_tokens=False).input_ids == tok.encode(text), text
    ids = tok.encode(text)
    ids = ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids  # our decode stops at EOS
    assert auto.decode(ids) == tok.decode(tok.encode(text)), text
  real_pad = tok.pad_id if tok.pad_id < tok.vocab_size else None
  assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (
      tok.bos_id if tok.bos_id >= 0 else None, tok.eos_id, real_pad)
  return auto


def test_save_hf_round_trip_of_a_sentencepiece_model(sentencepiece, tmp_path):
  sp = sentencepiece
  assert [sp.token_to_id(m) for m in tokenizer_lib.CHAT_TOKENS] == [5, 6, 7, 8]
  assert sp.token_to_id("no such piece") is None and sp.token_to_id("<unk>") == sp.unk_id
  out = str(tmp_path / "hf")
  sp.save_hf(out)
  auto = auto_matches(sp, out)
  assert auto.unk_token_id == sp.unk_id and len(auto) == sp.vocab_size
  back = tokenizer_lib.load(out)  # tokenizer.json + tokenizer_config.json: same ids and special ids
  assert isinstance(back, tokenizer_lib.HFTokenizer)
  assert (back.bos_id, back.eos_id, back.unk_id, back.pad_id) == (sp.bos_id, sp.eos_id, sp.unk_id, sp.pad_id)
  assert all(back.encode(t) == sp.encode(t) for t in TEXTS)
  # Preprocessing workers build their encoder from `encoder_model`: the same ids, "<s>" in text included.
  assert tokenizer_formats.encoder(back.encoder_model).encode(TEXTS) == [sp.encode(t) for t in TEXTS]


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_save_hf_round_trip_of_an_hf_tokenizer(kind, request, tmp_path):
  tok = tokenizer_lib.load(request.getfixturevalue(f"{kind}_dir"))
  tok.save_hf(str(tmp_path))
  auto_matches(tok, str(tmp_path))
  with open(tmp_path / "tokenizer.json", "rb") as f:
    assert f.read() == tok.model_proto  # copied unchanged
  if kind == "llama3":  # the original config's other entries are kept
    with open(tmp_path / "tokenizer_config.json") as f:
      assert json.load(f)["chat_template"] == "{{ messages }}"


def test_bad_input_is_a_one_line_error_naming_the_path(tmp_path, sentencepiece):
  missing = str(tmp_path / "nope.json")
  with pytest.raises(FileNotFoundError, match="nope.json"):
    tokenizer_lib.load(missing)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="empty.*neither tokenizer.json nor tokenizer.model"):
    tokenizer_lib.load(str(tmp_path / "empty"))
  not_tok = tmp_path / "data.json"
  not_tok.write_text('{"records": [1, 2, 3]}')
  with pytest.raises(ValueError, match="data.json' is not an HF tokenizer.json") as e:
    tokenizer_lib.load(str(not_tok))
  assert "\n" not in str(e.value)
  no_eos = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
  os.makedirs(tmp_path / "noeos")
  no_eos.save(str(tmp_path / "noeos" / "tokenizer.json"))
  with pytest.raises(ValueError, match="noeos.*has no end-of-text token"):
    tokenizer_lib.load(str(tmp_path / "noeos"))
  write_json(tmp_path / "noeos" / "tokenizer_config.json", {"eos_token": "</s>"})
  with pytest.raises(ValueError, match="tokenizer_config.json names eos_token '</s>', which is not in"):
    tokenizer_lib.load(str(tmp_path / "noeos"))
  unigram = tokenizer_lib.train_tokenizer(TRAIN_TEXTS, str(tmp_path / "u.model"), vocab_size=340,
                                          model_type="unigram", num_threads=1)
  with pytest.raises(ValueError, match="u.model'.*model_type=unigram"):
    unigram.save_hf(str(tmp_path / "u_hf"))


def test_sample_without_a_data_dir_uses_the_given_tokenizer(llama3_dir, gpt2_dir, tmp_path):
  """An imported model has no DATA_DIR: infer --tokenizer encodes the prompt and decodes the continuation."""
  tok = tokenizer_lib.load(llama3_dir)
  model = model_lib.GPTConfig(vocab_size=512, num_layers=1, num_heads=2, d_model=16, d_ff=32, max_len=32,
                              dtype="float32")
  config = config_lib.TrainConfig(model_dir=str(tmp_path), data_dir="", seq_len=16, batch_size=8,
                                  mesh_shape={"data": -1})
  exp = experiment_lib.Experiment(config, model, optimizer_lib.OptimizerConfig())
  abstract = jax.eval_shape(lambda: model_lib.GPT(exp.model_config).init(jax.random.key(0),
                                                                         jax.numpy.zeros((1, 1), "int32")))
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda a: rng.normal(0, 0.5, a.shape).astype(np.float32),
                        jax.tree.map(lambda a: getattr(a, "value", a), abstract["params"],
                                     is_leaf=lambda a: hasattr(a, "value")))
  manager = checkpointing.make_manager(str(tmp_path), async_save=False)
  checkpointing.save(manager, 0, {"params": params})
  manager.close()
  with pytest.raises(ValueError, match="no tokenizer to encode the prompts"):
    text.sample(exp, ["x"], max_new_tokens=2)
  prompt = "def read(self):\n    return"
  step, texts = text.sample(exp, [prompt], max_new_tokens=2, tokenizer=llama3_dir)
  greedy = generate_by_recompute(params, np.array([tok.encode(prompt)]), config=exp.model_config,
                                          max_new_tokens=2)
  assert step == 0 and texts == [tok.decode(np.asarray(greedy)[0])]
  gpt2 = tokenizer_lib.load(gpt2_dir)  # its pad id needs a row past its vocabulary
  exp.model_config = dataclasses.replace(exp.model_config, vocab_size=gpt2.vocab_size)
  with pytest.raises(ValueError, match=f"tokenizer.json' has {gpt2.vocab_size} ids .pad id {gpt2.vocab_size}. but the "
                     f"model's vocabulary has {gpt2.vocab_size} rows"):
    text.sample(exp, [prompt], max_new_tokens=1, tokenizer=gpt2_dir)
