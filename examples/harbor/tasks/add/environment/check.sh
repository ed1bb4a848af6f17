#!/bin/bash
# The agent's checker: reads /app/answer.txt (never runs it) and says whether its last number is the sum.
answer=$(grep -oE -- '-?[0-9]+' /app/answer.txt | tail -n 1)
if [ "$answer" = "802" ]; then echo correct; else echo "incorrect, try again"; fi
