#!/bin/bash
awk '{print NF}' /app/words.txt > /app/counts.txt
