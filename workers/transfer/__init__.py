"""A refit's wire: how a trainer's bytes reach an engine rank's receive area
(docs/contract.md §4 "Refit"): transports, packing and landing, one step's exchange,
and an engine rank's side held between updates."""
