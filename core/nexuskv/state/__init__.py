"""What state is and where it is: block keys, holdings, the index, restore points per state kind."""
