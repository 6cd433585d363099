// cuda_fp16.h for the CPU emulation: the types come with cuda_emu.h.
#pragma once
#include "cuda_emu.h"
