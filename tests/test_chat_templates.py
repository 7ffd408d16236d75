"""Hugging Face chat templates (Jinja) read into a data.ChatTemplate (interop/chat_templates.py): the ids our
ChatEncoder renders equal transformers' `apply_chat_template` on the same tokenizer, for ChatML (with a default
system turn), Llama 3 and Gemma (no system turn) shapes; templates a ChatTemplate cannot express are refused in one
line that says why. The templates are written here in each family's shape (no hub download)."""

import json
import os

import gin
import pytest
import tokenizers

from t5x_like import cli
from t5x_like.data import chat
from t5x_like.data import chat_synth
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.interop import chat_templates

CHATML = ("{%- if messages[0]['role'] != 'system' %}"
          "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
          "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = ("{{- bos_token }}{%- for m in messages %}"
          "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
          "{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
GEMMA = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' %}"
         "{%- set first = messages[0]['content'] + '\\n\\n' %}"
         "{%- set turns = messages[1:] %}{%- else %}{%- set first = '' %}{%- set turns = messages %}{%- endif %}"
         "{%- for m in turns %}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m['content'] | trim "
         "+ '<end_of_turn>\\n' }}"
         "{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}")
MISTRAL = ("{{ bos_token }}{%- for m in messages %}"
           "{%- if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{%- elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{%- endif %}{%- endfor %}")
THINK = CHATML.replace("'<|im_start|>' + m['role'] + '\\n' + m['content']",
                       "'<|im_start|>' + m['role'] + '\\n' + ('<think>\\n\\n</think>\\n\\n' if loop.last and "
                       "m['role'] == 'assistant' else '') + m['content']")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
# (Jinja source, bos, eos) per family
FAMILIES = {"chatml": (CHATML, None, "<|im_end|>"), "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
            "gemma": (GEMMA, "<bos>", "<eos>")}
CONVERSATION = [("system", "Be brief."), ("user", "reverse: self path"), ("assistant", "path self"),
                ("user", "reverse: data list"), ("assistant", "list data")]


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory):
  """A byte-level BPE tokenizer.json with every family's special tokens added."""
  hf = tokenizers.Tokenizer(tokenizers.models.BPE())
  hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = tokenizers.decoders.ByteLevel()
  text = " ".join(chat_synth.WORDS) + "\nreverse: Be brief. You are a helpful assistant.\nuser system assistant model"
  hf.train_from_iterator([text] * 5, tokenizers.trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  hf.add_special_tokens(SPECIALS)
  path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
  hf.save(path)
  return path


def family_folder(root, tokenizer_json: str, source: str, bos, eos, **settings) -> str:
  """A HF tokenizer folder: tokenizer.json and a tokenizer_config.json with the chat template (and `settings`)."""
  os.makedirs(root, exist_ok=True)
  with open(tokenizer_json, encoding="utf-8") as f, open(os.path.join(root, "tokenizer.json"), "w") as g:
    g.write(f.read())
  config = {"eos_token": eos, "chat_template": source, **({"bos_token": bos} if bos else {}), **settings}
  with open(os.path.join(root, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)
  return str(root)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_render_the_ids_transformers_renders(family, hf_tokenizer_json, tmp_path):
  """`convert from_hf`'s reading of the folder's template (convert_folder → chat_template.gin, parsed back by gin):
  ChatEncoder's ids for a whole conversation (without our EOS) and for a generation prompt equal transformers'
  apply_chat_template; Gemma has no system turn (said in the note; a conversation with one is malformed)."""
  transformers = pytest.importorskip("transformers")
  source, bos, eos = FAMILIES[family]
  folder = family_folder(tmp_path / family, hf_tokenizer_json, source, bos, eos)
  gin_text, report = chat_templates.convert_folder(folder, tokenizer_lib.load(folder))
  assert gin_text is not None, report
  gin.clear_config()
  cli.register(chat.ChatTemplate, "data")
  gin.parse_config(gin_text)
  template = cli.configured(chat.ChatTemplate, "data")
  gin.clear_config()
  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"),
                                                bos_token=bos, eos_token=eos)
  hf_tok.chat_template = source
  encoder = chat.ChatEncoder(tokenizer_lib.load(folder), template)
  messages = CONVERSATION if template.system else CONVERSATION[1:]
  as_dicts = lambda ms: [{"role": r, "content": c} for r, c in ms]
  ids = lambda ms, gen: list(hf_tok.apply_chat_template(as_dicts(ms), tokenize=True, add_generation_prompt=gen,
                                                        return_dict=False))
  assert encoder.render(messages).ids.tolist()[:-1] == ids(messages, False)
  assert encoder.prompt_ids(messages[:-1]) == ids(messages[:-1], True)
  assert encoder.prompt_ids(CONVERSATION[1:2]) == ids(CONVERSATION[1:2], True)  # ChatML: its default system turn
  assert encoder.turns_of(encoder.render(messages).ids) == [m for m in messages]
  if family == "gemma":
    assert not template.system and "no system turn" in report and template.assistant == "<start_of_turn>model\n"
    with pytest.raises(chat.MalformedLine, match="system_unsupported"):
      encoder.render(CONVERSATION)
  if family == "chatml":
    assert template.default_system == "You are a helpful assistant." and template.prefix == ""


@pytest.mark.parametrize("source,why", [
    (MISTRAL, "a ChatTemplate has one end marker"),
    (THINK, "its second user turn ends with"),
])
def test_templates_a_chat_template_cannot_express_are_refused_in_one_line(source, why, hf_tokenizer_json, tmp_path):
  folder = family_folder(tmp_path / "f", hf_tokenizer_json, source, "<bos>", "<eos>")
  gin_text, report = chat_templates.convert_folder(folder, tokenizer_lib.load(folder))
  assert gin_text is None and why in report and folder in report and "\n" not in report
  assert "not expressible as a data.ChatTemplate" in report


def test_marker_tokens_split_at_special_pieces_and_refuse_plain_text(hf_tokenizer_json, tmp_path):
  """A multi-token marker starts with a special piece; each special piece in it is its own id, also where encoding
  text would split it (split_special_tokens, as here); text that merely starts with an ordinary token ('<' of
  '<|user|>' here) is not a marker."""
  folder = family_folder(tmp_path / "f", hf_tokenizer_json, CHATML, None, "<|im_end|>", split_special_tokens=True)
  tok = tokenizer_lib.load(folder)
  assert len(tok.encode("<|end_header_id|>")) > 1  # text never reads a special token here
  special = tok.special_pieces()
  ids = chat.marker_tokens(tok, "<|start_header_id|>user<|end_header_id|>\n\n")
  assert ids[0] == special["<|start_header_id|>"] and special["<|end_header_id|>"] in ids
  assert ids == [special["<|start_header_id|>"], *tok.encode("user"), special["<|end_header_id|>"],
                 *tok.encode("\n\n")]
  assert chat.marker_tokens(tok, "<|user|>") is None
  assert chat.marker_tokens(tok, "<|im_end|>") == [special["<|im_end|>"]]
  with pytest.raises(chat.MalformedLine, match="marker_in_content"):  # the special piece alone, inside content
    chat.ChatEncoder(tok, chat.ChatTemplate(system="<|im_start|>system\n", user="<|im_start|>user\n",
                                            assistant="<|im_start|>assistant\n", end="<|im_end|>")).render(
        [("user", "a <|im_start|> b"), ("assistant", "c")])
