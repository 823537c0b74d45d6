"""Load an exported run with `transformers` alone and decode greedily (the last step of walkthrough.sh).

    python examples/data/check_export.py export/stdlib --prompt "def " --max-new-tokens 40

Prints the prompt and its continuation, as `shardwise generate RUN --temperature 0` does for the same weights.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("directory")
parser.add_argument("--prompt", required=True)
parser.add_argument("--max-new-tokens", type=int, default=40)
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.directory)  # the export's tokenizer.json and tokenizer_config.json
model = AutoModelForCausalLM.from_pretrained(args.directory)
ids = torch.tensor([tokenizer.encode(args.prompt)])
# the EOS to stop at comes from the export's generation_config.json (the dataset's end-of-text token)
out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                     pad_token_id=model.generation_config.eos_token_id)
print(tokenizer.decode(out[0], clean_up_tokenization_spaces=False))
