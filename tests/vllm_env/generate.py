"""Generate greedily with vllm.LLM on the CPU and print the tokens as JSON:

    generate.py MODEL_DIR [ADDITIONAL_CONFIG_JSON]
"""
import json
import os
import sys

from vllm import LLM, SamplingParams


def main() -> None:
    kwargs = {}
    if len(sys.argv) > 2:
        kwargs["additional_config"] = json.loads(sys.argv[2])
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128,
              max_num_seqs=4, seed=0, **kwargs)
    prompts = [{"prompt_token_ids": [1, 17, 42, 99, 7]}, {"prompt_token_ids": [3, 300, 12]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, detokenize=False))
    print("PLED-TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    if os.environ.get("PLED_TEST_HOLD"):  # keep the engine up while the test asks pled who is attached
        print("PLED-HOLDING", flush=True)
        sys.stdin.readline()


if __name__ == "__main__":
    main()
