// The whole public C++ API of turnout.
#pragma once

#include "turnout/bootstrap.hpp"
#include "turnout/buffer.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"
#include "turnout/internode.hpp"
#include "turnout/intranode.hpp"
#include "turnout/layout.hpp"
#include "turnout/low_latency.hpp"
#include "turnout/topology.hpp"
