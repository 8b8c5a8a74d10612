import json, random, statistics, subprocess, sys, time
import requests
name, n, length, n_predict = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
st = json.loads(subprocess.run([sys.executable, "-m", "moeplug", "status", "--json"], capture_output=True, text=True).stdout)
url = next(s["url"] for s in st["servers"] if s["name"] == name)
n_vocab = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["meta"]["n_vocab"]
rng = random.Random(int(time.time()))
pp, tg = [], []
for i in range(n):
    prompt = [rng.randint(10, n_vocab - 10) for _ in range(length)]
    r = requests.post(f"{url}/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                  "cache_prompt": False, "ignore_eos": True}, timeout=600).json()
    t = r["timings"]
    pp.append(t["prompt_per_second"]); tg.append(t["predicted_per_second"])
    print(f"request {i}: prompt {t['prompt_n']} tokens {t['prompt_per_second']:.1f} t/s, decode {t['predicted_n']} {t['predicted_per_second']:.1f} t/s", flush=True)
print(f"median prefill {statistics.median(pp):.1f} t/s, decode {statistics.median(tg):.1f} t/s over {n} requests")
