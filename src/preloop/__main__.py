"""`python -m preloop` is the `preloop` command."""

from preloop.cli import main

main()
