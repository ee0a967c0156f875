# expect: fail output_form — returns a view of its input `gate`: no result of its own.
import torch


def silu_mul(gate, up):
    return gate.view(gate.shape)
