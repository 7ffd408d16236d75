"""Chat inference and evaluation by generation: `infer --chat` answers as the engine does, exact match of a
model whose answers are known, the reference loss against the input pipeline's, and bad lines named by file:line."""

import json
import re

import jax
import numpy as np
import pytest

from tests import conftest

from t5x_like.data import chat
from t5x_like.data import chat_synth
from t5x_like.data import input_pipeline
from t5x_like.data import preprocessing
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.model import decoder as model_lib
from t5x_like.parallel import partitioning
from t5x_like.inference import chat_eval
from tests.decode_reference import generate_by_recompute
from t5x_like.training import checkpointing
from t5x_like.training import config as config_lib
from t5x_like.recipes import experiment as experiment_lib
from t5x_like.training import optimizer as optimizer_lib

TINY = model_lib.GPTConfig(num_layers=1, num_heads=2, d_model=32, d_ff=64, max_len=64, dtype="float32",
                           tie_embeddings=False)
CLI_MODEL = [f"--gin.model.GPTConfig.{k}={v}" for k, v in dict(
    num_layers=1, num_heads=2, d_model=32, d_ff=64, max_len=64, dtype="'float32'", tie_embeddings=False).items()]
CLI_MODEL += ["--gin.SEQ_LEN=56", "--gin.BATCH_SIZE=8"]
ANSWER = "path self"  # what the `answering` model says to anything
RIGHT = [{"prompt": "reverse: self path", "completion": ANSWER},
         {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: self path"},
                       {"role": "assistant", "content": ANSWER}]},
         {"messages": [{"role": "user", "content": "reverse: file path self"}, {"role": "assistant", "content": "x"},
                       {"role": "user", "content": "again, two"}, {"role": "assistant", "content": f" {ANSWER}\n"}]}]
WRONG = [{"prompt": "reverse: path self", "completion": "self path"},
         {"messages": [{"role": "user", "content": "value of a"}, {"role": "assistant", "content": "value"}]}]


def write_lines(path, objects) -> str:
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(o) + "\n" for o in objects)
  return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A tokenizer, a chat DATA_DIR of RIGHT + WRONG (all in the train split), the Experiment, and two checkpoints:
  `random` (large random weights: decisive greedy choices) and `answering` (always says ANSWER, then stops)."""
  root = tmp_path_factory.mktemp("chat_infer")
  texts = [" ".join(chat_synth.WORDS) + "\nreverse: value of again, two be brief\n"] * 20
  tok = tokenizer_lib.train_tokenizer(texts, str(root / "tok.model"), vocab_size=360, num_threads=1)
  files = {"right": write_lines(root / "right.jsonl", RIGHT), "wrong": write_lines(root / "wrong.jsonl", WRONG),
           "mixed": write_lines(root / "mixed.jsonl", RIGHT + WRONG)}
  data_dir = str(root / "data")
  preprocessing.preprocess([files["mixed"]], data_dir, tokenizer=tok.path, data_format="chat", num_train_shards=1,
                           validation_fraction=0.0, progress=False, cache_dir=None)
  config = config_lib.TrainConfig(model_dir=str(root / "random"), data_dir=data_dir, batch_size=8, seq_len=56,
                                  mesh_shape={"data": -1})
  exp = experiment_lib.Experiment(config, TINY, optimizer_lib.OptimizerConfig())
  encoder = chat_eval.encoder_for(exp, chat.ChatTemplate())
  abstract = partitioning.unbox(exp.boxed_params)
  rng = np.random.RandomState(0)
  random = jax.tree.map(lambda x: rng.normal(0.0, 1.0, x.shape).astype(np.float32), abstract)
  checkpointing.save_params(str(root / "random"), random)
  answering = answering_params(random, encoder)
  checkpointing.save_params(str(root / "answering"), answering)
  return {"root": root, "tok": tok, "files": files, "data_dir": data_dir, "exp": exp, "encoder": encoder,
          "random": random, "answering": answering}


def answering_params(params, encoder):
  """Parameters whose greedy continuation of the assistant marker is ANSWER then the end marker, whatever
  the prompt: attention and MLP outputs zeroed, so the last hidden state is LayerNorm(embedding of the
  current token), and the output head maps each token of the chain marker → ANSWER → end to the next."""
  p = jax.tree.map(np.array, params)
  for name in ("attn/out", "mlp_out"):
    block = p["blocks"]
    for key in name.split("/"):
      block = block[key]
    block["kernel"][:] = 0.0
    block["bias"][:] = 0.0
  p["position_embedding"][:] = 0.0
  p["ln_f"]["scale"][:], p["ln_f"]["bias"][:] = 1.0, 0.0
  chain = [encoder.marker_ids["assistant"], *encoder.tokenizer.encode(ANSWER), encoder.marker_ids["end"]]
  assert len(set(chain)) == len(chain), chain
  head = p["lm_head"]
  head["kernel"][:], head["bias"][:] = 0.0, 0.0
  for current, following in zip(chain, chain[1:]):
    e = p["token_embedding"][current]
    normed = (e - e.mean()) / np.sqrt(e.var() + TINY.layer_norm_epsilon)
    head["kernel"][:, following] = 10.0 * normed / np.linalg.norm(normed)
  return p


def run_cli(monkeypatch, capsys, module: str, *args) -> tuple:
  """(exit code, stdout, stderr) of `python -m t5x_like.<module>` with the tests' model, run in this process
  (8 devices)."""
  capsys.readouterr()
  code = conftest.run_entry_point(monkeypatch, module, ["--gin_file=configs/models/gpt_tiny.gin",
                                               "--gin_file=configs/runs/pretrain.gin", *CLI_MODEL, *args])
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_infer_chat_writes_the_greedy_answers(setup, tmp_path, monkeypatch, capsys):
  lines = chat_eval.read_chat_lines(setup["files"]["mixed"])
  encoder, tok = setup["encoder"], setup["tok"]
  prompts = [encoder.prompt_ids(line.messages) for line in lines]
  # the prompt is the rendering preprocess trains on, cut before the reference turn's content
  doc = encoder.render(list(lines[2].messages) + [("assistant", lines[2].reference)])
  assert prompts[2] == doc.ids[:doc.turn_ends[-2] + 1].tolist() and prompts[2][-1] == encoder.marker_ids["assistant"]
  # the cache-free greedy reference, cut at the end marker or EOS
  texts = [encoder.completion_text(np.asarray(generate_by_recompute(
      setup["random"], np.array([p]), config=setup["exp"].model_config, max_new_tokens=6))[0]) for p in prompts]
  assert len(set(texts)) == len(texts) and all(texts)  # distinct, non-empty answers: a meaningful comparison
  out = tmp_path / "out.jsonl"
  code, stdout, stderr = run_cli(monkeypatch, capsys, "infer", "--chat", f"--prompt_file={setup['files']['mixed']}",
                                 f"--output_file={out}", "--max_new_tokens=6", "--batch_size=2",
                                 f"--gin.MODEL_DIR='{setup['root'] / 'random'}'",
                                 f"--gin.DATA_DIR='{setup['data_dir']}'")
  assert code in (None, 0), stderr[-3000:]
  assert f"{len(lines)} answers written to {out}" in stdout
  written = [json.loads(line) for line in open(out, encoding="utf-8")]
  assert [w["messages"][-1] for w in written] == [{"role": "assistant", "content": t} for t in texts]
  assert [[(m["role"], m["content"]) for m in w["messages"][:-1]] for w in written] == [list(l.messages) for l in lines]


def evaluate(setup, params, name="mixed"):
  """chat_eval.evaluate of a prompt file with the shapes of the other tests (one compiled generation)."""
  exp = setup["exp"]
  with exp.context():
    return chat_eval.evaluate(params, setup["encoder"], chat_eval.read_chat_lines(setup["files"][name],
                                                                                 require_reference=True),
                              objective=exp.model_objective, config=exp.model_config, batch_size=5,
                              max_new_tokens=6)


def test_exact_match_of_a_model_with_known_answers(setup):
  report = evaluate(setup, setup["answering"])
  # the three RIGHT lines match (whitespace around the reference ignored), the two WRONG ones do not
  assert report["generate/examples"] == 5 and report["generate/exact_matches"] == 3
  assert report["generate/exact_match"] == 0.6
  mixed = setup["files"]["mixed"]
  assert report["generate/mismatches"] == [
      {"where": f"{mixed}:4", "prediction": ANSWER, "reference": "self path"},
      {"where": f"{mixed}:5", "prediction": ANSWER, "reference": "value"}]
  assert evaluate(setup, setup["random"])["generate/exact_match"] == 0.0
  # the default generation budget: the longest reference (' path self\n' with its spaces) and its end marker
  lines = chat_eval.read_chat_lines(setup["files"]["mixed"])
  assert max(len(setup["tok"].encode(line.reference)) for line in lines) == len(setup["tok"].encode(f" {ANSWER}\n"))


def test_reference_loss_is_the_input_pipelines_loss_on_the_preprocessed_file(setup, monkeypatch):
  """The teacher-forced rows are the input pipeline's: with preprocess's weights (which the single-answer lines'
  reference weights are, see the next test) the loss equals Experiment.evaluate's over the same file written by
  preprocess (packed rows, the TF pipeline). A second evaluation reads the same batches from the pipeline the
  first one built (Experiment.eval_dataset), building none."""
  exp, encoder = setup["exp"], setup["encoder"]
  lines = chat_eval.read_chat_lines(setup["files"]["mixed"])
  docs = [encoder.render(list(line.messages) + [("assistant", line.reference)]) for line in lines]
  with exp.context():
    loss_sum, weight_sum = chat_eval.reference_loss(exp.model_objective, setup["random"],
                                                    [(d.ids, d.weights) for d in docs],
                                                    pad_id=encoder.tokenizer.pad_id, batch_size=5)
    pipeline = exp.evaluate(setup["random"], split="train")
  assert weight_sum == pipeline["eval/tokens"] == sum(d.weights[1:].sum() for d in docs)
  np.testing.assert_allclose(loss_sum / weight_sum, pipeline["eval/loss"], rtol=2e-5)
  assert 3.0 < pipeline["eval/loss"] < 30.0  # random weights: far from 0
  built = []
  monkeypatch.setattr(input_pipeline, "make_dataset", lambda *a, **k: built.append(a) or None)
  with exp.context():
    assert exp.evaluate(setup["random"], split="train") == pipeline and not built
  # the reported loss counts the reference turns only: the multi-turn line's first answer drops out
  report = evaluate(setup, setup["random"])
  first_answer = len(setup["tok"].encode("x")) + 1  # "x" and its end marker
  assert report["generate/tokens"] == weight_sum - first_answer
  with exp.context():
    want = chat_eval.reference_loss(exp.model_objective, setup["random"],
                                    chat_eval.reference_documents(encoder, lines), pad_id=encoder.tokenizer.pad_id,
                                    batch_size=5)
  np.testing.assert_allclose(report["generate/loss"], want[0] / want[1], rtol=1e-6)


def test_reference_weights_cover_the_last_assistant_turn_only(setup):
  encoder = setup["encoder"]
  line = chat_eval.read_chat_lines(setup["files"]["right"])[2]
  ((ids, weights),) = chat_eval.reference_documents(encoder, [line])
  doc = encoder.render(list(line.messages) + [("assistant", line.reference)])
  assert ids.tolist() == doc.ids.tolist()
  start = doc.turn_ends[-2]
  assert weights[start:].tolist() == doc.weights[start:].tolist() and weights[:start].sum() == 0
  assert doc.weights[:start].sum() > 0  # preprocess also weights the earlier answer "x"
  assert encoder.tokenizer.decode(ids[weights == 1]) == f" {ANSWER}\n<|end|>"
  features = chat_eval.reference_features([(ids, weights)], 40, encoder.tokenizer.pad_id)
  n = len(ids)
  assert features["targets"][0, :n - 1].tolist() == ids[1:].tolist()
  assert features["weights"][0].tolist() == weights[1:].tolist() + [0.0] * (41 - n)


@pytest.mark.slow  # fast subset: the developer loop; CI runs it
def test_evaluate_generate_cli_reports_exact_match_and_writes_json(setup, tmp_path, monkeypatch, capsys):
  report_path = tmp_path / "report.json"
  code, stdout, stderr = run_cli(monkeypatch, capsys, "evaluate", "--generate",
                                 f"--prompt_file={setup['files']['mixed']}", f"--output_file={report_path}",
                                 "--batch_size=2", "--max_new_tokens=6",
                                 f"--gin.MODEL_DIR='{setup['root'] / 'answering'}'",
                                 f"--gin.DATA_DIR='{setup['data_dir']}'")
  assert code in (None, 0), stderr[-3000:]
  report = json.loads(open(report_path, encoding="utf-8").read())
  assert json.loads(stdout.strip().splitlines()[-1]) == report
  assert f"exact match 0.6000 (3/5)" in stdout
  want = evaluate(setup, setup["answering"])  # batches of 5, not the CLI's 2
  assert report["step"] == 0 and report["prompt_file"] == setup["files"]["mixed"]
  for key in ("generate/examples", "generate/exact_matches", "generate/exact_match", "generate/mismatches",
              "generate/tokens", "generate/max_new_tokens"):
    assert report[key] == want[key], key
  np.testing.assert_allclose(report["generate/loss"], want["generate/loss"], rtol=1e-5)


@pytest.mark.parametrize("line, message", [
    ("{not json", r"bad_json"),
    (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}), r"unknown_role: messages\[0\] has role 'robot'"),
    (json.dumps({"prompt": "  "}), r"empty_content: message 0 \(user\)"),
    (json.dumps({"text": "hi"}), r"wrong_shape: missing key 'messages'"),
    (json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}), r"wrong_shape: no turn before the answer"),
    (json.dumps({"prompt": "what is <|end|>?"}), r"marker_in_content: user content contains a template marker"),
])
def test_a_bad_line_is_a_one_line_error_naming_file_and_line(setup, tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(RIGHT[0]) + "\n\n" + line + "\n")
  with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: {message}") as raised:
    chat_eval.encode_prompts(setup["encoder"], chat_eval.read_chat_lines(str(path)))
  assert "\n" not in str(raised.value)


def test_evaluate_needs_a_reference_and_a_template_that_matches_the_data_dir(setup, tmp_path):
  path = write_lines(tmp_path / "prompts.jsonl", [RIGHT[0], {"prompt": "reverse: a b"}])
  assert chat_eval.read_chat_lines(path)[1] == chat_eval.ChatLine(f"{path}:2", (("user", "reverse: a b"),), None)
  with pytest.raises(ValueError, match=rf"^{re.escape(path)}:2: no reference answer"):
    chat_eval.read_chat_lines(path, require_reference=True)
  exp = setup["exp"]
  assert chat_eval.template_for(exp.manifest, "d", chat.ChatTemplate()) == chat.ChatTemplate()
  bound = chat.ChatTemplate(separator="")
  with pytest.raises(ValueError, match=r"data.ChatTemplate bindings differ from the template DATA_DIR 'd' was "
                                       r"written with \(field: \(bound, written\)\) \{'separator': \('', '\\n'\)\}"):
    chat_eval.template_for(exp.manifest, "d", bound)
  assert chat_eval.template_for(None, "", bound) == bound  # no chat DATA_DIR: the bound template
  with pytest.raises(ValueError, match=rf"{re.escape(path)}:1: prompt \+ max_new_tokens is 13 \+ 60 = 73 tokens, "
                                       r"more than the model's max_len=64"):
    chat_eval.check_fits(chat_eval.read_chat_lines(path), [13, 5], 60, 64, "prompt + max_new_tokens")
