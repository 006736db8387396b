/* cuda_runtime_api.h - for the host build of csrc/cuda/ (fs_emu_rt.h). */
#include "fs_emu_rt.h"
