"""CLI sub-commands: parse options, call the library, print results. No logic here."""
