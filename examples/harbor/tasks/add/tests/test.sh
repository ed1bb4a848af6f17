#!/bin/bash
# Reward 1 when the last number of /app/answer.txt is 417 + 385.
answer=$(grep -oE -- '-?[0-9]+' /app/answer.txt 2>/dev/null | tail -n 1)
if [ "$answer" = "802" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
