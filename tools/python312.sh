#!/bin/sh
# Prints the Python 3.12 the project's environment is made with (the Makefile's PYTHON): a
# python3.12 that runs, else pyenv's newest 3.12 (pyenv's shim answers only for the versions
# pyenv has selected), else python3.12, so that make's error names what is missing.
if python3.12 -c '' 2>/dev/null; then
  echo python3.12
  exit 0
fi
if command -v pyenv >/dev/null 2>&1; then
  version=$(pyenv versions --bare 2>/dev/null | grep '^3\.12\.' | sort -V | tail -1)
  if [ -n "$version" ]; then
    echo "$(pyenv root)/versions/$version/bin/python3.12"
    exit 0
  fi
fi
echo python3.12
