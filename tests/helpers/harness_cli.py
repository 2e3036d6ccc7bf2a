"""A harness that is a program of its own: reads its session from the environment (OPENAI_BASE_URL,
TOOLKIT_TASK, TOOLKIT_REWARD_URL), runs two turns with the synchronous ``openai`` SDK, posts its reward.
Session 1 crashes (exit 3)."""

import json
import os
import sys
import urllib.request

import openai

task = json.loads(os.environ["TOOLKIT_TASK"])
if task["index"] == 1:
    print("harness: cannot start the sandbox", file=sys.stderr)
    sys.exit(3)
client = openai.OpenAI(timeout=60, max_retries=2)  # base URL and key from the environment
messages = [{"role": "user", "content": "Say something."}]
for _ in range(2):
    out = client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
    messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                 {"role": "user", "content": "Again."}]
req = urllib.request.Request(os.environ["TOOLKIT_REWARD_URL"], data=json.dumps({"reward": 0.25}).encode(),
                             headers={"content-type": "application/json",
                                      "authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
urllib.request.urlopen(req, timeout=30).read()
