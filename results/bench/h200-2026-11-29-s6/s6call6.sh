#!/bin/bash
export PYTHONPATH=.
date -u
timeout 300 python3 .dev/s6/host.py 2>&1 | tail -30
