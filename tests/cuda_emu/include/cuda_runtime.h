#pragma once
#include "cuda_emu_prelude.h"
