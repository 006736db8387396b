/* cuda_fp16.h - for the host build of the kernels (fs_emu.h). */
#include "fs_emu.h"
