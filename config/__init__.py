"""The shipped training configs, installed as package data of ``named.configs``: ``named-train --config gpt2_nano``
reads ``gpt2_nano.yaml`` from here when no such file is in the working directory."""
