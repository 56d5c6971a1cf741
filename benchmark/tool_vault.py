"""A task that only a tool solves, small enough to learn on a CPU in minutes: each prompt's vault holds a secret word,
drawn at random from 8; the reward is 1 when the policy's last turn is that word. A policy that does not open the vault
scores 1/8 at best; one that calls open_vault() and says what it returns scores 1.

The policy is the tests' tiny Llama (byte-level BPE, ~2M parameters, random weights) after supervised steps on
conversations of a weak tool user: 30% of them call open_vault and then say the word it returned, the others answer a
word at random at once. Before RL it calls the tool about a third of the time (reward ~0.4); RL has to make it call
the tool, and keep saying what the tool returned. SmolLM2-135M-Instruct, the only pretrained model on this machine,
wrote no tool call in 32 samples with a tool-calling template (it has not learnt the format), hence the warm start,
as RL fine-tuning of tool use starts from a model that knows the format (an instruct model, or after SFT).

    python benchmark/tool_vault.py --out tool_vault        # the policy and the data (about 3 minutes on 2 cores)
    python rloo.py --model_name_or_path tool_vault/policy --dataset_name tool_vault/data \\
        --environment benchmark/tool_vault.py:Vault --reward_funcs benchmark/tool_vault.py:said_the_word ...

benchmark/experiments/tool_vault.sh runs it over seeds; docs/tools.md shows the curve.
"""

import argparse
import json
import os
import random
import sys

WORDS = ["good", "bad", "fine", "sad", "happy", "long", "short", "funny"]  # the secrets: 1/8 by chance
PROMPT = "open the vault and say its word"
CALLS, USES = 0.3, 1.0
OPEN_CALL = '<tool_call>{"name": "open_vault", "arguments": {}}</tool_call>'  # one token of the tokenizer
# A Hermes-style template (Qwen2.5's layout, shortened): the tools in a system turn, a call as <tool_call>{json}
# </tool_call> in the assistant's turn, a result as <tool_response> in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Vault:
    """The environment: reset with the row's secret word; its one tool opens the vault."""

    def reset(self, secret, **row):
        self.secret = secret

    def open_vault(self) -> str:
        """Opens the vault and reads the word inside."""
        return self.secret


def said_the_word(completions, environments, **kwargs) -> list[float]:
    """1 when the last turn is the vault's secret word (whatever came before it), else 0."""
    return [
        float(messages[-1]["role"] == "assistant" and messages[-1]["content"].strip() == vault.secret)
        for messages, vault in zip(completions, environments)
    ]


def build(out: str, seed: int, sft_steps: int) -> None:
    import torch
    from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from conftest import build_tiny_models

    base = build_tiny_models(os.path.join(out, "base"))
    tokenizer = AutoTokenizer.from_pretrained(base["policy"])
    tokenizer.add_tokens([AddedToken(OPEN_CALL, normalized=False, special=False)])
    tokenizer.chat_template = CHAT_TEMPLATE
    policy = AutoModelForCausalLM.from_pretrained(base["policy"])
    policy.resize_token_embeddings(len(tokenizer), mean_resizing=False)

    rng = random.Random(seed)
    schema = get_json_schema(Vault().open_vault)
    call = {"type": "function", "function": {"name": "open_vault", "arguments": {}}}
    demonstrations = []
    for _ in range(256):  # a weak tool user: it calls 30% of the time, and then says the word the tool returned
        secret = rng.choice(WORDS)
        conversation = [{"role": "user", "content": PROMPT}]
        answer = rng.choice(WORDS)
        if rng.random() < CALLS:
            conversation += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "open_vault", "content": secret},
            ]
            answer = secret if rng.random() < USES else answer
        conversation.append({"role": "assistant", "content": answer})
        text = tokenizer.apply_chat_template(conversation, tools=[schema], tokenize=False)
        demonstrations.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for step in range(sft_steps):
        ids = torch.tensor([demonstrations[step % len(demonstrations)]])
        policy(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    policy.save_pretrained(os.path.join(out, "policy"))
    tokenizer.save_pretrained(os.path.join(out, "policy"))

    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    for split, rows in [("train", 256), ("test", 32)]:
        with open(os.path.join(out, "data", f"{split}.jsonl"), "w") as f:
            for _ in range(rows):
                row = {"prompt": [{"role": "user", "content": PROMPT}], "secret": rng.choice(WORDS)}
                f.write(json.dumps(row) + "\n")
    print(f"the policy in {out}/policy, the data in {out}/data")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the policy and the data (made; must not exist)")
    parser.add_argument("--seed", type=int, default=0, help="of the demonstrations, the SFT and the data")
    parser.add_argument("--sft_steps", type=int, default=4000, help="supervised steps on the demonstrations")
    options = parser.parse_args()
    if os.path.exists(options.out):
        parser.error(f"{options.out} exists already: give a new folder")
    build(options.out, options.seed, options.sft_steps)
