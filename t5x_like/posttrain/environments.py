"""Multi-turn rollouts with tools: environments registered by name, and episodes played against them by the engine.

An environment is a Python callable registered with `@environments.register("name")`, called after each assistant
turn with the conversation so far ([(role, content)], the prompt's turns then the episode's) and the prompt's
reference answer; it returns an `EnvReply`: the tool's or the user's next message (rendered as a user turn: the
chat template has no tool role), or done with the episode's reward.

An episode (`play`): the prompt, then turns of [the policy's sampled tokens, exactly as the engine produced them
(token in, token out: never re-tokenised from text); the environment's reply rendered by the chat template] until
the environment says done, the episode reaches GrpoConfig.max_turns assistant turns (cut and counted, reward 0),
or its tokens would pass SEQ_LEN + 1 or the model's max_len (cut and counted, reward 0). The policy's tokens get
loss weight 1, the environment's 0. An environment that raises on an episode drops it (reward NaN: counted and never trained on).

The shipped environment, `calculator`: a question "a op b" (posttrain/environments.py `calculator_examples`), a
tool call "calc <expression>" answered "= <value>", and a final answer. Reward 1 when the episode called the tool
with an expression whose value is the reference and then answered exactly the reference; else 0.
"""

import ast
import dataclasses
import operator
import random
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from t5x_like.posttrain import rollout


@dataclasses.dataclass(frozen=True)
class EnvReply:
  """What an environment answers an assistant turn with."""
  message: Optional[str] = None  # the tool's or user's next message (None when done)
  done: bool = False
  reward: float = 0.0  # read when done


Environment = Callable[..., EnvReply]  # (messages [(role, content)], reference) -> EnvReply
_REGISTRY: Dict[str, Environment] = {}


def register(name: str) -> Callable[[Environment], Environment]:
  def wrap(fn):
    _REGISTRY[name] = fn
    return fn
  return wrap


def get(name: str, owner: str = "GrpoConfig") -> Environment:
  """The environment registered as `name` (the setting `owner`.environment).

  Raises:
    ValueError: one line naming the setting, the name and the registered ones.
  """
  if name not in _REGISTRY:
    raise ValueError(f"{owner}.environment={name!r} is not a registered environment (registered: "
                     f"{', '.join(sorted(_REGISTRY))}); register one with "
                     f"@t5x_like.posttrain.environments.register({name!r})")
  return _REGISTRY[name]


# ----------------------------------------------------------------------------------------------------
# The calculator.

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
TOOL_PREFIX = "calc "


def evaluate(expression: str) -> Optional[int]:
  """The value of an integer expression of + − × and parentheses, or None (anything else, or too long)."""
  if len(expression) > 64:
    return None
  try:
    tree = ast.parse(expression.strip(), mode="eval").body
  except SyntaxError:
    return None

  def value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:  # pylint: disable=unidiomatic-typecheck
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -value(node.operand)
    raise ValueError(ast.dump(node))

  try:
    return value(tree)
  except (ValueError, RecursionError):
    return None


@register("calculator")
def calculator(messages: Sequence[tuple], reference: str) -> EnvReply:
  """A tool call "calc <expression>" gets "= <value>" (or "= error"); any other assistant turn is the final answer."""
  last = messages[-1][1].strip()
  if last.startswith(TOOL_PREFIX):
    result = evaluate(last[len(TOOL_PREFIX):])
    return EnvReply(message=f"= {'error' if result is None else result}")
  called = any(role == "assistant" and content.strip().startswith(TOOL_PREFIX)
               and str(evaluate(content.strip()[len(TOOL_PREFIX):])) == reference.strip()
               for role, content in messages[:-1])
  return EnvReply(done=True, reward=float(called and last == reference.strip()))


def calculator_examples(count: int, seed: int = 0, *, tool_turns: bool = True) -> list:
  """Chat lines of the calculator task: "a op b" with a, b in [10, 99] and op in {+, *}. With `tool_turns`, the
  demonstration (SFT data): the tool call, its result and the answer; without, the question and its answer only
  (the prompts and references of rollouts)."""
  rng = random.Random(seed)
  out = []
  for _ in range(count):
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+*")
    question, answer = f"{a} {op} {b}", str(evaluate(f"{a} {op} {b}"))
    turns = [("user", question)]
    if tool_turns:
      turns += [("assistant", f"{TOOL_PREFIX}{question}"), ("user", f"= {answer}")]
    turns.append(("assistant", answer))
    out.append({"messages": [{"role": r, "content": c} for r, c in turns]})
  return out


# ----------------------------------------------------------------------------------------------------
# Episodes.


def play(rollouts: "rollout.Rollouts", params, prompt_set: "rollout.PromptSet", indices: np.ndarray, *,
         environment: Environment, seed: int, max_turns: int, temperature: float, top_k: int) -> rollout.Episodes:
  """Plays one episode per entry of `indices` (prompts of `prompt_set`) against `environment`, all episodes' turns
  sampled together; see the module docstring.

  Returns:
    Episodes whose `completions` are the tokens after each prompt (policy and environment), `masks` 1 on the
    policy's, `logprobs` the engine's log-probs of the policy's tokens, and metrics in `extra`.
  """
  config, encoder = rollouts.objective_config, rollouts.encoder
  budget = min(rollouts.exp.config.seq_len + 1, rollouts.exp.model_config.max_len)  # a row, and the KV cache
  n = len(indices)
  tokens = [list(prompt_set.prompts[i]) for i in indices]
  start = [len(t) for t in tokens]
  masks, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
  messages = [encoder.turns_of(prompt_set.prompts[i]) for i in indices]
  rewards = np.zeros(n)
  active = list(range(n))
  turns, cut, tool_calls = np.zeros(n, np.int32), np.zeros(n, bool), np.zeros(n, np.int32)
  for turn in range(max_turns):
    if not active:
      break
    room = [budget - len(tokens[i]) for i in active]
    over = [i for i, r in zip(active, room) if r < 1]
    for i in over:
      cut[i] = True
    active = [i for i in active if i not in over]
    if not active:
      break
    turn_seed = rollout.step_seed(seed, turn)
    completions, lps = rollouts.sample(params, [tokens[i] for i in active], n=1, seed=turn_seed,
                                       temperature=temperature, top_k=top_k,
                                       max_tokens=[min(config.max_new_tokens, budget - len(tokens[i])) for i in active])
    still = []
    for i, completion, lp in zip(active, completions, lps):
      tokens[i] += completion
      masks[i] += [1] * len(completion)
      logprobs[i] += lp
      turns[i] += 1
      text = encoder.completion_text(completion)
      tool_calls[i] += text.strip().startswith(TOOL_PREFIX)
      messages[i].append(("assistant", text))
      try:
        reply = environment(messages[i], prompt_set.references[indices[i]])
      except Exception:  # pylint: disable=broad-except
        rewards[i] = np.nan
        continue
      if reply.done:
        rewards[i] = float(reply.reward)
        continue
      follow = encoder.next_turn_ids("user", reply.message)
      if len(tokens[i]) + len(follow) >= budget:
        cut[i] = True
        continue
      tokens[i] += follow
      masks[i] += [0] * len(follow)
      messages[i].append(("user", reply.message))
      still.append(i)
    active = still
  cut[active] = True  # never said done within max_turns
  return rollout.Episodes(np.asarray(indices), [tokens[i][:start[i]] for i in range(n)],
                          [tokens[i][start[i]:] for i in range(n)], logprobs, rewards, 0.0, masks=masks,
                          extra={"episodes_cut": float(cut.sum()), "turns": float(turns.mean()),
                                 "tool_calls": float(tool_calls.mean())})

