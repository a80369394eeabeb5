"""perfrun: train a GPT on your own GPU and measure what each performance knob buys."""

__version__ = "0.1.0"
