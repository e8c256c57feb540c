"""vram's size-class rule (include/vram/size_classes.hpp) in Python, for exact checks of
allocated_bytes: 4 classes per power of two, at least 256 bytes."""


def round_up(nbytes):
    if nbytes <= 256:
        return 256
    m = nbytes - 1
    k = m.bit_length() - 1  # 2^k <= m < 2^(k+1)
    quarter = (m >> (k - 2)) & 3
    return (1 << k) + (quarter + 1) * (1 << (k - 2))
