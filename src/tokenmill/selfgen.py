"""Text a model writes itself, for the tools that need text in the model's own distribution and have no
dataset: `train-mtp`'s training data (spec/train_mtp.py) and `quantize`'s calibration (quant/offline.py).

Prompts: instructions "Write <kind> about <topic>." over every (kind, topic) pair, shuffled by a seed and
cycled to the number wanted, in the model's chat template (a plain line without one)."""
from __future__ import annotations

import random

KINDS = ["a short story", "a news report", "an explanation for a student", "a letter to a friend", "a recipe",
         "a product review", "a dialogue between two people", "a summary of the history", "a list of tips",
         "a travel guide entry", "a short essay", "a museum placard"]
TOPICS = ["the ocean", "a small bakery", "volcanoes", "the first railway", "learning a language", "honey bees",
          "a rainy city", "chess", "the moon landing", "gardening in winter", "an old lighthouse", "bicycles",
          "the printing press", "deserts", "a school concert", "coffee", "glaciers", "a lost key",
          "the human heart", "public libraries", "electric cars", "a mountain village", "owls", "bridges"]


def chat_prompt(llm, text: str) -> str:
    """`text` as one user turn of the model's chat template, ready for the assistant's answer."""
    try:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a tokenizer without a chat template: the plain instruction
        return text + "\n"


def instruction_prompts(llm, n: int, seed: int) -> list[str]:
    """n writing instructions (see the module docstring), reproducible from seed."""
    rng = random.Random(seed)
    pairs = [(k, t) for k in KINDS for t in TOPICS]
    rng.shuffle(pairs)
    return [chat_prompt(llm, f"Write {kind} about {topic}.") for kind, topic in (pairs * (n // len(pairs) + 1))[:n]]


def written_sequences(llm, n: int, max_tokens: int, seed: int) -> list[list[int]]:
    """n token sequences (prompt + answer) sampled from llm (temperature 0.8, top-p 0.95, seed + i each)."""
    from tokenmill import SamplingParams
    prompts = instruction_prompts(llm, n, seed)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
