// Forwarding header: the communication API is public (include/mlacp/comm.h).
#pragma once
#include "mlacp/comm.h"
