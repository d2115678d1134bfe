"""A stand-in workload for backend tests, run under real torchrun like trainforge.trainer.train.

Reads ``--config job.json`` and does what its ``fake`` block says: print numbered lines, sleep,
write the result file like the trainer does (rank 0), exit with a code.
"""

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True)
args = parser.parse_args()
fake = json.load(open(args.config))["fake"]
rank = int(os.environ.get("RANK", "0"))
for i in range(fake.get("lines", 3)):
    print(f"rank{rank} line {i}", flush=True)
    time.sleep(fake.get("line_sleep_s", 0.0))
time.sleep(fake.get("sleep_s", 0.0))
if rank == 0 and fake.get("result_status"):
    path = os.environ["TRAINFORGE_RESULT_FILE"]
    with open(path + ".tmp", "w") as fh:
        json.dump(
            {
                "status": fake["result_status"],
                "exit_code": fake.get("exit_code", 0),
                "message": fake.get("message", ""),
                "final_step": 7,
            },
            fh,
        )
    os.replace(path + ".tmp", path)
sys.exit(fake.get("exit_code", 0))
